package workload

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

const (
	westID   = "spiffe://oc.example/cluster/west"
	westIss  = "https://west.example"
	audience = "tokenbroker.east"
	livePod  = "7a1e2f3c-0000-4000-8000-000000000002"
	goneePod = "7a1e2f3c-0000-4000-8000-000000000003"
	newPod   = "7a1e2f3c-0000-4000-8000-000000000004"
)

// westCluster is a peer cluster's signing key and its published set.
type westCluster struct {
	key *ecdsa.PrivateKey
	kid string
	raw []byte
}

func newWestCluster(t *testing.T) westCluster {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	kid, err := pki.KubernetesKeyID(key.Public())
	require.NoError(t, err)
	raw, err := pki.EncodeJWKS(map[string]crypto.PublicKey{kid: key.Public()})
	require.NoError(t, err)
	return westCluster{key: key, kid: kid, raw: raw}
}

// token is a projected token of argo/runner bound to the Pod with uid,
// issued at iat.
func (w westCluster) token(t *testing.T, podUID string, iat time.Time) string {
	t.Helper()
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims{
		"iss": westIss, "aud": []string{audience}, "sub": "system:serviceaccount:argo:runner",
		"iat": iat.Unix(), "nbf": iat.Unix(), "exp": iat.Add(10 * time.Minute).Unix(),
		"kubernetes.io": map[string]any{
			"namespace":      "argo",
			"serviceaccount": map[string]any{"name": "runner", "uid": "7a1e2f3c-0000-4000-8000-000000000001"},
			"pod":            map[string]any{"name": "runner-" + podUID[len(podUID)-4:], "uid": podUID},
		},
	})
	tok.Header["kid"] = w.kid
	s, err := tok.SignedString(w.key)
	require.NoError(t, err)
	return s
}

func livePodsPolicy(t *testing.T, wi string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(`
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: ` + westID + `
    workloadIdentity: {issuer: "` + westIss + `", audiences: [` + audience + `], jwksFromPeer: true, requirePodBinding: true` + wi + `}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`))
	require.NoError(t, err)
	return p
}

func reason(t *testing.T, err error) string {
	t.Helper()
	var pe *problem.Error
	require.True(t, errors.As(err, &pe), "%v", err)
	return pe.Reason
}

func kind(t *testing.T, err error) problem.Kind {
	t.Helper()
	var pe *problem.Error
	require.True(t, errors.As(err, &pe), "%v", err)
	return pe.Kind
}

// TestATokenIsHonouredOnlyWhileItsPodIsInAFreshReport: with
// livePodsFromPeer, a pod-bound token verifies only while the peer's last
// report lists its Pod and is younger than livePodsMaxAge; a deleted Pod's
// token (left out of the next report) is refused at once.
func TestATokenIsHonouredOnlyWhileItsPodIsInAFreshReport(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	w := newWestCluster(t)
	p := livePodsPolicy(t, ", livePodsFromPeer: true, livePodsMaxAge: 1m")
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	report := func(uids ...string) error {
		now = now.Add(MinReportInterval) // the agent's pace
		_, err := store.ReportLivePods(ctx, p, westID, uids, now, &audit.Event{})
		return err
	}
	// Issued a minute ago, while both Pods lived.
	live, gone := w.token(t, livePod, now.Add(-time.Minute)), w.token(t, goneePod, now.Add(-time.Minute))

	err := report(livePod)
	require.Equal(t, problem.KindUnprocessable, kind(t, err), "a report before the key set: %v", err)
	require.ErrorContains(t, err, "PUT /v1/peers/self/jwks")

	_, err = store.Upload(ctx, p, westID, w.raw, now, &audit.Event{})
	require.NoError(t, err)
	_, err = Verify(p, westID, live, store, clock)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "keys but no report yet")

	require.NoError(t, report(livePod, goneePod))
	got, err := Verify(p, westID, live, store, clock)
	require.NoError(t, err)
	require.Equal(t, "argo", got.Namespace)
	_, err = Verify(p, westID, gone, store, clock)
	require.NoError(t, err, "still listed")

	require.NoError(t, report(livePod)) // the Pod was deleted
	_, err = Verify(p, westID, gone, store, clock)
	require.Equal(t, TokenPodNotLive, reason(t, err))
	require.Contains(t, workloadTokenDetails[TokenPodNotLive], "deleted")
	_, err = Verify(p, westID, live, store, clock)
	require.NoError(t, err)

	// A token issued since the last report, of a Pod not in it: the Pod
	// lived after the report (a new one): refused for now, retryable.
	_, err = Verify(p, westID, w.token(t, newPod, now), store, clock)
	var pe *problem.Error
	require.ErrorAs(t, err, &pe)
	require.Equal(t, problem.KindUnavailable, pe.Kind)
	require.Equal(t, PodNotReportedYet, pe.Reason)
	require.Equal(t, time.Second, pe.RetryAfter)
	require.NoError(t, report(livePod, newPod))
	_, err = Verify(p, westID, w.token(t, newPod, now.Add(-time.Second)), store, clock)
	require.NoError(t, err, "reported")

	// A new key set keeps the report.
	w2 := newWestCluster(t)
	_, err = store.Upload(ctx, p, westID, w2.raw, now, &audit.Event{})
	require.NoError(t, err)
	_, err = Verify(p, westID, w2.token(t, livePod, now), store, clock)
	require.NoError(t, err, "the report survives a key rotation")

	// The report goes stale when the agent stops reporting.
	now = now.Add(time.Minute)
	_, err = Verify(p, westID, live, store, clock)
	require.NoError(t, err, "exactly livePodsMaxAge old")
	now = now.Add(time.Second)
	_, err = Verify(p, westID, live, store, clock)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "a stale report refuses every token")
	require.NoError(t, report(livePod))
	_, err = Verify(p, westID, w.token(t, livePod, now), store, clock)
	require.NoError(t, err, "reported again")

	// Another replica reads the same report from the Secret.
	other := NewPeerKeyStore(store.secrets, "tokenbroker", zap.NewNop())
	sec, err := other.read(ctx, "west")
	require.NoError(t, err)
	other.observe(sec)
	_, err = Verify(p, westID, w.token(t, livePod, now), other, clock)
	require.NoError(t, err)
	_, err = Verify(p, westID, w.token(t, goneePod, now.Add(-time.Minute)), other, clock)
	require.Equal(t, TokenPodNotLive, reason(t, err))
}

func TestOnlyAPeerWhosePolicySaysSoReportsItsPods(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	w := newWestCluster(t)
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	without := livePodsPolicy(t, "")
	_, err := store.Upload(ctx, without, westID, w.raw, now, &audit.Event{})
	require.NoError(t, err)
	_, err = store.ReportLivePods(ctx, without, westID, []string{livePod}, now, &audit.Event{})
	require.Equal(t, problem.KindForbidden, kind(t, err))
	with := livePodsPolicy(t, ", livePodsFromPeer: true")
	_, err = store.ReportLivePods(ctx, with, "spiffe://oc.example/cluster/north", []string{livePod}, now, &audit.Event{})
	require.Equal(t, problem.KindForbidden, kind(t, err), "an unknown peer")

	// Without livePodsFromPeer, the report is not consulted.
	_, err = Verify(without, westID, w.token(t, goneePod, now), store, func() time.Time { return now })
	require.NoError(t, err)
}

func TestAReportIsBoundedAndValidated(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	w := newWestCluster(t)
	p := livePodsPolicy(t, ", livePodsFromPeer: true")
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	_, err := store.Upload(ctx, p, westID, w.raw, now, &audit.Event{})
	require.NoError(t, err)
	many := make([]string, MaxLivePods+1)
	for i := range many {
		many[i] = fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
	}
	for name, tc := range map[string]struct {
		uids   []string
		detail string
	}{
		"too many":       {many, "at most 1024"},
		"not a uid":      {[]string{livePod, "../../etc"}, "uids[1] is not a Pod uid"},
		"upper case":     {[]string{strings.ToUpper(livePod)}, "uids[0] is not a Pod uid"},
		"listed twice":   {[]string{livePod, livePod}, "uids[1] is listed twice"},
		"a uid and more": {[]string{livePod + "x"}, "not a Pod uid"},
	} {
		_, err := store.ReportLivePods(ctx, p, westID, tc.uids, now, &audit.Event{})
		var pe *problem.Error
		require.ErrorAs(t, err, &pe, name)
		require.Equal(t, problem.KindInvalid, pe.Kind, name)
		require.Len(t, pe.Fields, 1, name)
		require.Equal(t, "uids", pe.Fields[0].Field, name)
		require.Contains(t, pe.Fields[0].Detail, tc.detail, name)
	}
	resp, err := store.ReportLivePods(ctx, p, westID, many[:MaxLivePods], now, &audit.Event{})
	require.NoError(t, err, "exactly the bound")
	require.Equal(t, MaxLivePods, resp.Pods)
	require.Equal(t, now.Add(policy.DefaultLivePodsMaxAge).UTC(), resp.ValidUntil)

	// A peer cannot make this replica write its Secret at will.
	_, err = store.ReportLivePods(ctx, p, westID, []string{}, now.Add(MinReportInterval/2), &audit.Event{})
	var pe *problem.Error
	require.ErrorAs(t, err, &pe)
	require.Equal(t, problem.KindTooManyRequests, pe.Kind)
	require.Equal(t, MinReportInterval/2, pe.RetryAfter)
	resp, err = store.ReportLivePods(ctx, p, westID, []string{}, now.Add(MinReportInterval), &audit.Event{})
	require.NoError(t, err, "no Pod lives")
	require.Zero(t, resp.Pods)
}

// TestAReportFromTheFutureOrHalfWrittenCountsAsNone: a report time ahead
// of this replica's clock by more than the skew (another replica's clock
// runs fast, or the Secret was edited) does not extend the report's life;
// a report without its time is not carried into a new key set.
func TestAReportFromTheFutureOrHalfWrittenCountsAsNone(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	w := newWestCluster(t)
	p := livePodsPolicy(t, ", livePodsFromPeer: true")
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	_, err := store.Upload(ctx, p, westID, w.raw, now, &audit.Event{})
	require.NoError(t, err)
	_, err = store.ReportLivePods(ctx, p, westID, []string{livePod}, now.Add(time.Hour), &audit.Event{})
	require.NoError(t, err)
	_, err = Verify(p, westID, w.token(t, livePod, now), store, func() time.Time { return now })
	require.Equal(t, TokenPodsUnreported, reason(t, err), "a report an hour ahead")
	r, _ := store.LivePod("west", westID, livePod, now.Add(time.Hour-reportClockSkew), time.Minute)
	require.Empty(t, r)

	sec, err := store.read(ctx, "west")
	require.NoError(t, err)
	delete(sec.Annotations, AnnotationPodsReportedAt)
	next := newPeerKeysSecret("west", westID, w.raw)
	keepLivePods(sec, next)
	require.NotContains(t, next.Data, PeerLivePodsKey, "a report without its time is dropped, not kept half")
}
