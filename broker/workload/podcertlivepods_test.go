package workload

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// TestAPeerOfPodCertificatesAloneReportsItsPodsWithoutKeys: a peer that
// trusts pod certificates only has no keys to upload; its agent's report
// of the live Pods is taken at once, kept in the peer's one Secret alone,
// and its pod certificates are honoured only while their Pod is in a
// fresh report.
func TestAPeerOfPodCertificatesAloneReportsItsPodsWithoutKeys(t *testing.T) {
	ctx := context.Background()
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	now := func() time.Time { return at }
	p := podCertificatePolicy(t, "{podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 1m}")
	secrets := fake.NewClientset().CoreV1()
	store := NewPeerKeyStore(secrets, "tokenbroker", zap.NewNop())
	live, gone := westPod(livePod), westPod(goneePod)
	made := at.Add(-time.Hour)
	report := func(uids ...string) error {
		at = at.Add(MinReportInterval) // the agent's pace
		_, err := store.ReportLivePods(ctx, p, westID, uids, at, &audit.Event{})
		return err
	}

	_, err := VerifyPodCertificate(p, live, made, store, now)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "nothing reported yet")

	require.NoError(t, report(livePod, goneePod), "no key set needed")
	list, err := secrets.Secrets("tokenbroker").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	require.Len(t, list.Items, 1, "the peer's one Secret")
	sec := list.Items[0]
	require.Equal(t, PeerKeysSecretName("west"), sec.Name)
	require.Equal(t, map[string]string{
		objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PeerKeysKind, objects.LabelPeer: "west",
	}, sec.Labels)
	require.Equal(t, westID, sec.Annotations[objects.AnnotationIdentity])
	require.NotContains(t, sec.Data, PeerKeysCurrentKey, "no key set")
	require.NotContains(t, sec.Data, PeerKeysPreviousKey)
	require.JSONEq(t, `["`+livePod+`","`+goneePod+`"]`, string(sec.Data[PeerLivePodsKey]))
	require.Nil(t, store.Keys("west", westID, at, time.Hour), "no keys: no token verifies")
	_, err = Verify(p, westID, newWestCluster(t).token(t, livePod, made), store, now)
	require.Equal(t, TokenNoTrust, reason(t, err), "and none is trusted")

	got, err := VerifyPodCertificate(p, live, made, store, now)
	require.NoError(t, err)
	require.Equal(t, livePod, got.PodUID)
	_, err = VerifyPodCertificate(p, gone, made, store, now)
	require.NoError(t, err, "still listed")

	require.NoError(t, report(livePod)) // the Pod was deleted
	_, err = VerifyPodCertificate(p, gone, made, store, now)
	require.Equal(t, TokenPodNotLive, reason(t, err), "refused as soon as the report leaves its Pod out")
	_, err = VerifyPodCertificate(p, live, made, store, now)
	require.NoError(t, err)
	list, err = secrets.Secrets("tokenbroker").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	require.Len(t, list.Items, 1, "the same Secret, rewritten")

	// Another replica reads the report from the Secret.
	other := NewPeerKeyStore(secrets, "tokenbroker", zap.NewNop())
	stored, err := other.read(ctx, "west")
	require.NoError(t, err)
	other.observe(stored)
	_, err = VerifyPodCertificate(p, live, made, other, now)
	require.NoError(t, err)
	_, err = VerifyPodCertificate(p, gone, made, other, now)
	require.Equal(t, TokenPodNotLive, reason(t, err))

	// The report goes stale when the agent stops reporting.
	at = at.Add(time.Minute + time.Second)
	_, err = VerifyPodCertificate(p, live, made, store, now)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "a stale report refuses every pod certificate")
	require.Equal(t, problem.KindBadPodCertificate, kind(t, err))
}

// TestAReportWithoutKeysReplacesAnotherIdentitysSecretAndKeepsThePeersOwnKeys:
// a Secret that another identity wrote under the peer's name (a name
// reused in the policy) gives way to the report, its keys dropped; a
// Secret the peer itself wrote keeps what it holds.
func TestAReportWithoutKeysReplacesAnotherIdentitysSecretAndKeepsThePeersOwnKeys(t *testing.T) {
	ctx := context.Background()
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	w := newWestCluster(t)
	foreign := newPeerKeysSecret("west", "spiffe://oc.example/cluster/old-west", w.raw)
	foreign.Namespace = "tokenbroker"
	secrets := fake.NewClientset(foreign).CoreV1()
	store := NewPeerKeyStore(secrets, "tokenbroker", zap.NewNop())
	p := podCertificatePolicy(t, "{podCertificates: true, livePodsFromPeer: true}")

	_, err := store.ReportLivePods(ctx, p, westID, []string{livePod}, at, &audit.Event{})
	require.NoError(t, err)
	sec, err := store.read(ctx, "west")
	require.NoError(t, err)
	require.Equal(t, westID, sec.Annotations[objects.AnnotationIdentity])
	require.NotContains(t, sec.Data, PeerKeysCurrentKey, "the other identity's keys are gone")
	r, _ := store.LivePod("west", westID, livePod, at, time.Minute)
	require.Empty(t, r)

	// The policy later trusts the peer's tokens too: its key upload joins
	// the report in the same Secret, with no previous set.
	both := podCertificatePolicy(t, `{podCertificates: true, issuer: "`+westIss+`", audiences: [`+audience+`], jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true}`)
	up, err := store.Upload(ctx, both, westID, w.raw, at, &audit.Event{})
	require.NoError(t, err)
	require.True(t, up.Changed)
	require.Empty(t, up.PreviousKeyIDs)
	sec, err = store.read(ctx, "west")
	require.NoError(t, err)
	require.Contains(t, sec.Data, PeerKeysCurrentKey)
	require.NotContains(t, sec.Data, PeerKeysPreviousKey)
	require.Contains(t, sec.Data, PeerLivePodsKey, "the report is kept")
	_, err = Verify(both, westID, w.token(t, livePod, at), store, func() time.Time { return at })
	require.NoError(t, err)

	// And a report of a peer that trusts pod certificates alone keeps keys
	// the peer uploaded itself (they verify nothing under this policy).
	_, err = store.ReportLivePods(ctx, p, westID, []string{}, at.Add(time.Second), &audit.Event{})
	require.NoError(t, err)
	sec, err = store.read(ctx, "west")
	require.NoError(t, err)
	require.Contains(t, sec.Data, PeerKeysCurrentKey)
	require.JSONEq(t, `[]`, string(sec.Data[PeerLivePodsKey]))
}

// TestAPeerThatTrustsTokensStillUploadsKeysFirst: with token trust the
// report waits for the key set, as before, pod certificates or not.
func TestAPeerThatTrustsTokensStillUploadsKeysFirst(t *testing.T) {
	ctx := context.Background()
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	p := podCertificatePolicy(t, `{podCertificates: true, issuer: "`+westIss+`", audiences: [`+audience+`], jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true}`)
	_, err := store.ReportLivePods(ctx, p, westID, []string{livePod}, time.Now(), &audit.Event{})
	require.Equal(t, problem.KindUnprocessable, kind(t, err))
	require.ErrorContains(t, err, "PUT /v1/peers/self/jwks")
}

// TestASecretWithNeitherKeysNorPodsVerifiesNothing: a hand-edited Secret
// that holds nothing the broker wrote is no key set.
func TestASecretWithNeitherKeysNorPodsVerifiesNothing(t *testing.T) {
	t.Parallel()
	for name, data := range map[string]map[string][]byte{
		"empty":                      {},
		"a previous set without one": {PeerKeysPreviousKey: newWestCluster(t).raw, PeerLivePodsKey: []byte(`[]`)},
	} {
		sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: PeerKeysSecretName("west"),
			Labels:      map[string]string{objects.LabelPeer: "west"},
			Annotations: map[string]string{objects.AnnotationIdentity: westID, AnnotationPodsReportedAt: time.Now().Format(time.RFC3339Nano)}}, Data: data}
		_, err := keySetFromSecret(sec)
		require.Error(t, err, name)
	}
}
