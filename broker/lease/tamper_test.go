package lease

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

var tamperNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// genuineLease is west's lease idA in namespace as the broker writes it
// (NewSecret), created at created, as the API server stores it.
func genuineLease(namespace string, created time.Time) *corev1.Secret {
	s := NewSecret(idA, namespace, Holder{Peer: "west", Identity: westID, Workload: "ci/runner"}, "runner",
		apiv1.CredentialClientCertificate, "grants[0]", tamperNow.Add(time.Hour))
	s.Labels[objects.LabelKeyFingerprint] = "fp"
	s.Annotations[objects.AnnotationUser] = "tokenbroker:west:fp"
	s.Annotations[objects.AnnotationAccess] = apiv1.AccessGateway
	s.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	s.UID = types.UID("uid-" + namespace)
	s.CreationTimestamp = metav1.NewTime(created)
	return s
}

func metaOfSecret(s *corev1.Secret) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: *s.ObjectMeta.DeepCopy()}
}

// tamperCounter is a counter under rules granting west argo and flux,
// which has seen west's intact lease in argo; gone records what it reports
// gone.
func tamperCounter(t *testing.T) (*Counter, *goneRecorder) {
	t.Helper()
	rules := &Rules{MaxAge: 24*time.Hour + AgeSlack, Peers: map[string]PeerRule{
		"west":  {Identity: westID, Namespaces: map[string]struct{}{"argo": {}, "flux": {}}},
		"south": {Identity: "spiffe://oc.example/cluster/south", Namespaces: map[string]struct{}{"argo": {}}},
	}}
	lc := NewCounter(nil, clocktesting.NewFakePassiveClock(tamperNow), zap.NewNop())
	lc.SetRules(func() *Rules { return rules })
	g := &goneRecorder{}
	lc.OnGone(g.record)
	lc.Observe(metaOfSecret(genuineLease("argo", tamperNow.Add(-time.Minute))))
	_, ok := lc.Holds("argo", objects.LeaseSecretPrefix+idA, "uid-argo", westID, tamperNow)
	require.True(t, ok, "the intact lease is held")
	return lc, g
}

// Every edit of what the broker wrote once and never changes, or of what
// a lease needs to be one, makes the lease someone else's edit: it holds
// and counts nothing from then on, and it is handed to the GC to revoke,
// as the holder's lease it was. Edits the broker itself makes, or that
// touch nothing it reads, change nothing.
func TestAnEditOfALeasesMarksMakesItTamperedWhateverTheEdit(t *testing.T) {
	t.Parallel()
	delLabel := func(k string) func(*metav1.ObjectMeta) { return func(o *metav1.ObjectMeta) { delete(o.Labels, k) } }
	delAnn := func(k string) func(*metav1.ObjectMeta) {
		return func(o *metav1.ObjectMeta) { delete(o.Annotations, k) }
	}
	label := func(k, v string) func(*metav1.ObjectMeta) { return func(o *metav1.ObjectMeta) { o.Labels[k] = v } }
	ann := func(k, v string) func(*metav1.ObjectMeta) { return func(o *metav1.ObjectMeta) { o.Annotations[k] = v } }
	for _, tc := range []struct {
		name     string
		edit     func(*metav1.ObjectMeta)
		tampered bool
	}{
		{name: "the lease-id label stripped", edit: delLabel(objects.LabelLeaseID), tampered: true},
		{name: "the lease-id label rewritten", edit: label(objects.LabelLeaseID, idB), tampered: true},
		{name: "the peer label stripped", edit: delLabel(objects.LabelPeer), tampered: true},
		{name: "the peer label rewritten to another peer", edit: label(objects.LabelPeer, "south"), tampered: true},
		{name: "the managed-by label stripped", edit: delLabel(objects.LabelManagedBy), tampered: true},
		{name: "the kind label stripped", edit: delLabel(objects.LabelKind), tampered: true},
		{name: "the kind label made a pooled Secret's", edit: label(objects.LabelKind, objects.PoolKind), tampered: true},
		{name: "the kind label made a key set's", edit: label(objects.LabelKind, objects.PeerKeysKind), tampered: true},
		{name: "the key fingerprint label stripped", edit: delLabel(objects.LabelKeyFingerprint), tampered: true},
		{name: "the identity annotation stripped", edit: delAnn(objects.AnnotationIdentity), tampered: true},
		{name: "the identity annotation rewritten to another peer's", edit: ann(objects.AnnotationIdentity, "spiffe://oc.example/cluster/south"), tampered: true},
		{name: "the workload annotation rewritten", edit: ann(objects.AnnotationWorkload, "ci/deployer"), tampered: true},
		{name: "the credential annotation rewritten", edit: ann(objects.AnnotationCred, apiv1.CredentialToken), tampered: true},
		{name: "the service account annotation rewritten", edit: ann(objects.AnnotationSA, "admin"), tampered: true},
		{name: "the user annotation rewritten", edit: ann(objects.AnnotationUser, "tokenbroker:west:other"), tampered: true},
		{name: "the access annotation stripped", edit: delAnn(objects.AnnotationAccess), tampered: true},
		{name: "the grant annotation stripped", edit: delAnn(objects.AnnotationGrant), tampered: true},
		{name: "the revoke-on-unmatch mark stripped", edit: delAnn(objects.AnnotationRevokeOnUnmatch), tampered: true},
		{name: "the expiry stripped", edit: delAnn(objects.AnnotationExpiresAt), tampered: true},
		{name: "the expiry made unreadable", edit: ann(objects.AnnotationExpiresAt, "tomorrow"), tampered: true},
		{name: "the expiry moved later", edit: ann(objects.AnnotationExpiresAt, tamperNow.Add(2*time.Hour).Format(time.RFC3339)), tampered: true},
		{name: "the credential id recorded, as the broker does after the answer", edit: ann(objects.AnnotationCredentialID, "X509SHA256=aa")},
		{name: "an earlier expiry recorded, as the broker does for a shortened credential", edit: ann(objects.AnnotationExpiresAt, tamperNow.Add(30*time.Minute).Format(time.RFC3339))},
		{name: "a label the broker does not read added", edit: label("team", "blue")},
		{name: "an annotation the broker does not read added", edit: ann("note", "hello")},
		{name: "a finalizer added", edit: func(o *metav1.ObjectMeta) { o.Finalizers = []string{"tenant.example/keep"} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			lc, g := tamperCounter(t)
			s := genuineLease("argo", tamperNow.Add(-time.Minute))
			tc.edit(&s.ObjectMeta)
			lc.Observe(metaOfSecret(s))
			name := objects.LeaseSecretPrefix + idA
			_, held := lc.Holds("argo", name, "uid-argo", westID, tamperNow)
			own, _ := lc.Live("west")
			holder, tampered := lc.TamperedHolder("argo", name, "uid-argo")
			if !tc.tampered {
				require.True(t, held)
				require.Equal(t, 1, own)
				require.False(t, tampered)
				require.Empty(t, lc.Tampered(10))
				require.Empty(t, g.gone)
				return
			}
			require.False(t, held, "the gateway refuses it")
			require.Zero(t, own, "it holds no place in a quota")
			require.Equal(t, []string{"argo/" + name + "/uid-argo"}, g.gone, "its open gateway streams end")
			require.True(t, tampered)
			require.Equal(t, westID, holder, "its holder is still known, for its revocation by id")
			require.Equal(t, []TamperedSecret{{Namespace: "argo", Name: name, UID: "uid-argo", Peer: "west", Identity: westID, Certificate: true}},
				lc.Tampered(10), "the GC revokes it as west's client-certificate lease")
			require.Empty(t, lc.LeaseRefs(), "the grant's coverage check has nothing to judge by it")
			require.False(t, lc.Claiming("argo", name), "it is no pooled Secret a claim could land on")
		})
	}
}

// A tenant cannot undo a tampering: restoring every mark leaves the
// Secret tampered until it is gone, and a Secret of another UID under the
// name is a new Secret.
func TestATamperedLeaseStaysTamperedUntilItIsGone(t *testing.T) {
	t.Parallel()
	lc, _ := tamperCounter(t)
	name := objects.LeaseSecretPrefix + idA
	s := genuineLease("argo", tamperNow.Add(-time.Minute))
	delete(s.Labels, objects.LabelLeaseID)
	lc.Observe(metaOfSecret(s))
	lc.Observe(metaOfSecret(genuineLease("argo", tamperNow.Add(-time.Minute)))) // every mark back
	_, held := lc.Holds("argo", name, "uid-argo", westID, tamperNow)
	require.False(t, held)
	require.Len(t, lc.Tampered(10), 1)

	again := genuineLease("argo", tamperNow)
	again.UID = "uid-new"
	lc.Observe(metaOfSecret(again))
	require.Empty(t, lc.Tampered(10), "another Secret, seen intact")
	_, held = lc.Holds("argo", name, "uid-new", westID, tamperNow)
	require.True(t, held)
}

// A Secret first seen without every mark of a lease is trusted for
// nothing, but the counter cannot tell it was the broker's: it is not
// handed to the GC (its holder's DELETE finds it by name).
func TestASecretFirstSeenWithoutTheMarksOfALeaseHoldsNothingAndIsNotRevokedBlind(t *testing.T) {
	t.Parallel()
	lc := NewCounter(nil, clocktesting.NewFakePassiveClock(tamperNow), zap.NewNop())
	s := genuineLease("argo", tamperNow)
	delete(s.Labels, objects.LabelLeaseID)
	lc.Observe(metaOfSecret(s))
	_, held := lc.Holds("argo", s.Name, s.UID, westID, tamperNow)
	require.False(t, held)
	require.Empty(t, lc.Tampered(10))
	require.Equal(t, []string{"argo"}, lc.NamespacesOf(s.Name), "a lookup by id still knows where it is")

	own, _ := lc.Live("west")
	require.Equal(t, 1, own, "its lease labels count it as before: only against its own peer")

	// Without the labels of a lease or a pooled Secret, a Secret of the
	// lease type is someone else's: indexed, never counted or collected.
	unlabelled := genuineLease("flux", tamperNow.Add(-2*time.Hour))
	unlabelled.Labels = nil
	unlabelled.Annotations[objects.AnnotationExpiresAt] = tamperNow.Add(-time.Hour).Format(time.RFC3339)
	lc.Observe(metaOfSecret(unlabelled))
	require.Equal(t, []string{"argo", "flux"}, lc.NamespacesOf(s.Name), "without any label too")
	own, total := lc.Live("west")
	require.Equal(t, 1, own)
	require.Equal(t, 1, total)
	require.Empty(t, lc.Expired(10), "nor is it collected at its expiry")
	require.Empty(t, lc.Tampered(10))
}

// A copy of a lease's name made in another namespace, later, is someone
// else's Secret: tampered or not, the GC never revokes it; the lease
// itself, tampered, it does.
func TestOnlyTheEarliestSecretOfANameIsRevokedAsTampered(t *testing.T) {
	t.Parallel()
	lc, _ := tamperCounter(t)
	copied := genuineLease("flux", tamperNow)
	lc.Observe(metaOfSecret(copied))
	delete(copied.Labels, objects.LabelPeer)
	lc.Observe(metaOfSecret(copied))
	require.Empty(t, lc.Tampered(10), "the copy is later than the lease")

	s := genuineLease("argo", tamperNow.Add(-time.Minute))
	delete(s.Labels, objects.LabelPeer)
	lc.Observe(metaOfSecret(s))
	got := lc.Tampered(10)
	require.Len(t, got, 1)
	require.Equal(t, "argo", got[0].Namespace)

	// On a tie of creation times, the first seen is the lease.
	tie, _ := tamperCounter(t)
	same := genuineLease("flux", tamperNow.Add(-time.Minute))
	tie.Observe(metaOfSecret(same))
	delete(same.Labels, objects.LabelPeer)
	tie.Observe(metaOfSecret(same))
	require.Empty(t, tie.Tampered(10))
}

// findStore is a Store over a fake clientset holding secrets and a counter
// (lc, nil for none) that saw them.
func findStore(t *testing.T, lc *Counter, secrets ...*corev1.Secret) (*Store, *fake.Clientset) {
	t.Helper()
	client := fake.NewClientset()
	for _, s := range secrets {
		_, err := client.CoreV1().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{})
		require.NoError(t, err)
		if lc != nil {
			lc.Observe(metaOfSecret(s))
		}
	}
	st := &Store{Secrets: client.CoreV1(), Clock: clocktesting.NewFakeClock(tamperNow)}
	if lc != nil {
		st.Counter = lc
	}
	return st, client
}

// The holder's lookup by id finds its lease by name and identity, whatever
// was done to its labels; it finds nothing that is not its own, and the
// earliest created of a name is the lease.
func TestFindFindsALeaseByItsNameWhateverItsLabels(t *testing.T) {
	t.Parallel()
	west := Holder{Peer: "west", Identity: westID}
	south := Holder{Peer: "south", Identity: "spiffe://oc.example/cluster/south"}
	runner := Holder{Peer: "west", Identity: westID, Workload: "ci/runner"}
	deployer := Holder{Peer: "west", Identity: westID, Workload: "ci/deployer"}
	for _, tc := range []struct {
		name  string
		edit  func(*corev1.Secret)
		found []Holder
		lost  []Holder
	}{
		{name: "every label stripped", edit: func(s *corev1.Secret) { s.Labels = nil }, found: []Holder{west, runner}, lost: []Holder{south, deployer}},
		{name: "the lease-id label rewritten", edit: func(s *corev1.Secret) { s.Labels[objects.LabelLeaseID] = idB }, found: []Holder{west, runner}, lost: []Holder{south}},
		{name: "the peer label rewritten to another peer", edit: func(s *corev1.Secret) { s.Labels[objects.LabelPeer] = "south" }, found: []Holder{west, runner}, lost: []Holder{south}},
		{name: "made a pooled Secret", edit: func(s *corev1.Secret) { s.Labels[objects.LabelKind] = objects.PoolKind }, found: []Holder{west}, lost: []Holder{south}},
		{name: "the identity rewritten to another peer's, with no counter that saw it before", edit: func(s *corev1.Secret) {
			s.Annotations[objects.AnnotationIdentity] = south.Identity
		}, found: []Holder{south}, lost: []Holder{west}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := genuineLease("argo", tamperNow)
			tc.edit(s)
			st, _ := findStore(t, nil, s)
			for _, h := range tc.found {
				got, err := st.Find(context.Background(), []string{"argo"}, h, idA, false)
				require.NoError(t, err, "%+v", h)
				require.Equal(t, s.UID, got.UID)
			}
			for _, h := range tc.lost {
				_, err := st.Find(context.Background(), []string{"argo"}, h, idA, false)
				require.Equal(t, problem.KindNotFound, problem.KindOf(err), "%+v", h)
			}
		})
	}
	t.Run("the identity rewritten after the counter saw it intact", func(t *testing.T) {
		t.Parallel()
		lc, _ := tamperCounter(t)
		intact := genuineLease("argo", tamperNow.Add(-time.Minute))
		s := intact.DeepCopy()
		s.Annotations[objects.AnnotationIdentity] = south.Identity
		st, _ := findStore(t, lc, s)
		got, err := st.Find(context.Background(), []string{"argo"}, west, idA, false)
		require.NoError(t, err, "the counter knows whose it was")
		require.Equal(t, s.UID, got.UID)
	})
	t.Run("the identity rewritten before the counter saw the edit", func(t *testing.T) {
		t.Parallel()
		lc, _ := tamperCounter(t) // saw it intact, not since
		s := genuineLease("argo", tamperNow.Add(-time.Minute))
		s.Annotations[objects.AnnotationIdentity] = south.Identity
		st, client := findStore(t, nil, s)
		st.Counter = lc
		got, err := st.Find(context.Background(), []string{"argo"}, west, idA, false)
		require.NoError(t, err, "the counter knows whose it was")
		require.Equal(t, s.UID, got.UID)
		_, err = client.CoreV1().Secrets("argo").Get(context.Background(), s.Name, metav1.GetOptions{})
		require.NoError(t, err)
	})
	t.Run("a later copy in another of the holder's namespaces is not the lease, whatever its labels", func(t *testing.T) {
		t.Parallel()
		s := genuineLease("argo", tamperNow.Add(-time.Minute))
		delete(s.Labels, objects.LabelLeaseID)
		copied := genuineLease("flux", tamperNow)
		copied.UID = "uid-copy"
		st, _ := findStore(t, nil, s, copied)
		got, err := st.Find(context.Background(), []string{"argo", "flux"}, west, idA, false)
		require.NoError(t, err)
		require.Equal(t, "argo", got.Namespace)
	})
	t.Run("an earlier Secret of the name that is not the holder's hides nothing it may take instead", func(t *testing.T) {
		t.Parallel()
		s := genuineLease("argo", tamperNow.Add(-time.Minute))
		s.Annotations[objects.AnnotationIdentity] = south.Identity // south's lease, by its identity
		copied := genuineLease("flux", tamperNow)
		st, _ := findStore(t, nil, s, copied)
		_, err := st.Find(context.Background(), []string{"argo", "flux"}, west, idA, false)
		require.Equal(t, problem.KindNotFound, problem.KindOf(err), "the lease of that id is not west's; its copy is not a lease")
	})
	t.Run("a Secret of another type is no lease", func(t *testing.T) {
		t.Parallel()
		s := genuineLease("argo", tamperNow)
		s.Type = corev1.SecretTypeOpaque
		st, _ := findStore(t, nil, s)
		_, err := st.Find(context.Background(), []string{"argo"}, west, idA, false)
		require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	})
}

// A GC pass revokes the tampered leases the counter knows in the
// namespaces it looks in, and counts those it deleted.
func TestAGCPassRevokesTheTamperedLeasesOfItsNamespaces(t *testing.T) {
	t.Parallel()
	for _, full := range []bool{false, true} {
		lc, _ := tamperCounter(t)
		s := genuineLease("argo", tamperNow.Add(-time.Minute))
		delete(s.Labels, objects.LabelLeaseID)
		st, _ := findStore(t, lc, s)
		var revoked []TamperedSecret
		pass := GCPass{Full: full, Now: tamperNow, MaxTTL: 24 * time.Hour,
			Delete:  func(context.Context, *corev1.Secret) error { return nil },
			Requeue: func(*corev1.Secret) {},
			RevokeTampered: func(_ context.Context, t TamperedSecret) (bool, error) {
				revoked = append(revoked, t)
				return true, nil
			}}
		pass.Namespaces = []string{"flux"}
		res, err := st.Collect(context.Background(), pass)
		require.NoError(t, err)
		require.Empty(t, revoked, "not a namespace this pass looks in")
		require.Zero(t, res.Tampered)

		pass.Namespaces = []string{"argo", "flux"}
		res, err = st.Collect(context.Background(), pass)
		require.NoError(t, err)
		require.Equal(t, 1, res.Tampered, "full: %v", full)
		require.Equal(t, []TamperedSecret{{Namespace: "argo", Name: s.Name, UID: s.UID, Peer: "west", Identity: westID, Certificate: true}}, revoked)
	}
}

// While the counter is blind, the gateway asks the API server, which
// answers by name and type: a lease stripped of a label is found, and
// refused, as from memory.
func TestRecheckRefusesALeaseWithoutEveryMarkOrOneTheCounterSawEdited(t *testing.T) {
	t.Parallel()
	rules := westRules()
	stored := func(edit func(*metav1.PartialObjectMetadata)) runtime.Object {
		m := storedLease("argo", "uid-1", tamperNow.Add(time.Hour))
		edit(m)
		return m
	}
	for name, tc := range map[string]struct {
		edit func(*metav1.PartialObjectMetadata)
		live bool
	}{
		"intact":                  {edit: func(*metav1.PartialObjectMetadata) {}, live: true},
		"the lease-id stripped":   {edit: func(m *metav1.PartialObjectMetadata) { delete(m.Labels, objects.LabelLeaseID) }},
		"the managed-by stripped": {edit: func(m *metav1.PartialObjectMetadata) { delete(m.Labels, objects.LabelManagedBy) }},
		"the kind stripped":       {edit: func(m *metav1.PartialObjectMetadata) { delete(m.Labels, objects.LabelKind) }},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			lc := NewCounter(fakeSecretsClient(t, stored(tc.edit)), clocktesting.NewFakePassiveClock(tamperNow), zap.NewNop())
			lc.SetRules(func() *Rules { return rules })
			_, live, err := lc.Recheck(context.Background(), "argo", "tokenbroker-lease-a", "uid-1", westID, tamperNow)
			require.NoError(t, err)
			require.Equal(t, tc.live, live)
		})
	}
	t.Run("an intact Secret the counter saw edited before", func(t *testing.T) {
		t.Parallel()
		lc := NewCounter(fakeSecretsClient(t, stored(func(*metav1.PartialObjectMetadata) {})), clocktesting.NewFakePassiveClock(tamperNow), zap.NewNop())
		lc.SetRules(func() *Rules { return rules })
		m := storedLease("argo", "uid-1", tamperNow.Add(time.Hour))
		lc.Observe(m.DeepCopy())
		delete(m.Labels, objects.LabelPeer)
		lc.Observe(m)
		_, live, err := lc.Recheck(context.Background(), "argo", "tokenbroker-lease-a", "uid-1", westID, tamperNow)
		require.NoError(t, err)
		require.False(t, live, "restored since, but tampered once")
	})
}

// The id a lease answers with is the one in its name.
func TestALeaseIsListedUnderTheIDOfItsName(t *testing.T) {
	t.Parallel()
	s := genuineLease("argo", tamperNow)
	s.Labels[objects.LabelLeaseID] = idB
	require.Equal(t, idA, ToAPI(s).ID)
	require.False(t, Intact(s))
	require.True(t, Intact(genuineLease("argo", tamperNow)))
	require.Equal(t, idA, IDOf(s.Name))
	require.Empty(t, IDOf("someone-elses"))
}
