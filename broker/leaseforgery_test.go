package broker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
)

// forgeryPolicy grants west argo and flux, and south kueue.
const forgeryPolicy = testPolicy + `
  - name: south
    identity: spiffe://oc.example/cluster/south
    grants:
      - {namespaces: [kueue], serviceAccounts: [admiralty-source]}
`

type forgeryEnv struct {
	b      *Broker
	lc     *lease.Counter
	client *fake.Clientset
	clock  *clocktesting.FakeClock
}

func newForgeryEnv(t *testing.T) *forgeryEnv {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Now().Truncate(time.Second))
	lc := lease.NewCounter(nil, clk, zap.NewNop())
	client := fake.NewClientset()
	b, err := New(Config{
		Secrets: client.CoreV1(),
		Issuers: map[string]Issuer{apiv1.CredentialToken: &fakeIssuer{}},
		Policy:  policy.NewStore(mustPolicy(t, forgeryPolicy)),
		Logger:  zap.NewNop(),
		Clock:   clk,
		Leases:  lc,
	})
	require.NoError(t, err)
	return &forgeryEnv{b: b, lc: lc, client: client, clock: clk}
}

// forged is the metadata of a lease Secret as the counter sees it.
func forged(ns, name, peer, identity string, created, expires time.Time) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{
		Namespace: ns, Name: name, UID: types.UID("uid-" + ns + "-" + name),
		CreationTimestamp: metav1.NewTime(created),
		Labels:            map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind, objects.LabelPeer: peer},
		Annotations: map[string]string{
			objects.AnnotationExpiresAt: expires.UTC().Format(time.RFC3339),
			objects.AnnotationIdentity:  identity,
		},
	}}
}

func TestOnlyLeaseSecretsThePolicyBearsOutCountAgainstAQuota(t *testing.T) {
	t.Parallel()
	const westID, southID = "spiffe://oc.example/cluster/west", "spiffe://oc.example/cluster/south"
	for _, tc := range []struct {
		name                string
		ns, peer, identity  string
		wantWest, wantSouth int
	}{
		{name: "a lease of the peer in a namespace its grants name counts", ns: "argo", peer: "west", identity: westID, wantWest: 1},
		{name: "a lease in a namespace no grant names counts for nothing", ns: "kube-system", peer: "west", identity: westID},
		{name: "a lease in a namespace granted only to another peer counts for nothing", ns: "kueue", peer: "west", identity: westID},
		{name: "a lease whose identity is another peer's counts for nothing", ns: "argo", peer: "west", identity: southID},
		{name: "a lease naming the other peer in a namespace of the first counts for nothing", ns: "argo", peer: "south", identity: southID},
		{name: "a lease naming a peer the policy does not know counts for nothing", ns: "argo", peer: "ghost", identity: westID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newForgeryEnv(t)
			now := e.clock.Now()
			e.lc.Observe(forged(tc.ns, "tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa", tc.peer, tc.identity, now, now.Add(time.Hour)))
			own, total := e.lc.Live("west")
			require.Equal(t, tc.wantWest, own)
			require.Equal(t, tc.wantWest+tc.wantSouth, total)
			own, _ = e.lc.Live("south")
			require.Equal(t, tc.wantSouth, own)
		})
	}
}

// A forged far-future expiry holds a place no longer than the longest
// lease could live (ttl.max, 24h, plus leaseAgeSlack); the GC still waits
// for the recorded expiry before it deletes anything.
func TestAFarFutureExpiryCountsOnlyUntilCreationPlusTheLongestTTL(t *testing.T) {
	t.Parallel()
	e := newForgeryEnv(t)
	now := e.clock.Now()
	e.lc.Observe(forged("argo", "tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa", "west", "spiffe://oc.example/cluster/west", now, now.AddDate(10, 0, 0)))
	own, _ := e.lc.Live("west")
	require.Equal(t, 1, own)

	e.clock.Step(24*time.Hour + 10*time.Minute - time.Second) // leaseAgeSlack: 10m
	e.lc.Sweep()
	own, _ = e.lc.Live("west")
	require.Equal(t, 1, own, "within ttl.max and the slack")

	e.clock.Step(time.Second)
	e.lc.Sweep()
	own, total := e.lc.Live("west")
	require.Zero(t, own)
	require.Zero(t, total)
	require.Empty(t, e.lc.Expired(10), "the GC waits for the recorded expiry")
}

func TestAPolicyReloadStopsCountingLeasesInANamespaceNoLongerGranted(t *testing.T) {
	t.Parallel()
	e := newForgeryEnv(t)
	now := e.clock.Now()
	e.lc.Observe(forged("flux", "tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa", "west", "spiffe://oc.example/cluster/west", now, now.Add(time.Hour)))
	own, _ := e.lc.Live("west")
	require.Equal(t, 1, own)

	e.b.cfg.Policy.Store(mustPolicy(t, `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - {namespaces: [argo], serviceAccounts: [admiralty-source]}
`))
	e.lc.Sweep()
	own, _ = e.lc.Live("west")
	require.Zero(t, own)
}

// forgedSecret is a copy of lease s that someone else made in namespace,
// later, with the Secret type typ.
func forgedSecret(s *corev1.Secret, namespace string, typ corev1.SecretType, created time.Time) *corev1.Secret {
	c := s.DeepCopy()
	c.Namespace, c.Type, c.UID, c.ResourceVersion = namespace, typ, "forged-"+c.UID, ""
	c.CreationTimestamp = metav1.NewTime(created)
	return c
}

func metaOf(s *corev1.Secret) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: *s.ObjectMeta.DeepCopy()}
}

func TestCopiesOfALeaseNeverHideItFromItsOwner(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		namespace string
		typ       corev1.SecretType
	}{
		{name: "a copy in a namespace granted only to another peer", namespace: "kueue", typ: objects.SecretTypeLease},
		{name: "a copy in a namespace no grant names", namespace: "kube-system", typ: objects.SecretTypeLease},
		{name: "a copy in another namespace of the same peer", namespace: "flux", typ: objects.SecretTypeLease},
		{name: "a copy of another type in another namespace of the same peer", namespace: "flux", typ: corev1.SecretTypeOpaque},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newForgeryEnv(t)
			ctx := context.Background()
			resp, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
			require.NoError(t, err)
			lease, err := e.client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+resp.LeaseID, metav1.GetOptions{})
			require.NoError(t, err)
			lease.UID, lease.CreationTimestamp = "genuine", metav1.NewTime(e.clock.Now())
			_, err = e.client.CoreV1().Secrets("argo").Update(ctx, lease, metav1.UpdateOptions{})
			require.NoError(t, err)
			e.lc.Observe(metaOf(lease))

			e.clock.Step(time.Minute)
			copied := forgedSecret(lease, tc.namespace, tc.typ, e.clock.Now())
			_, err = e.client.CoreV1().Secrets(tc.namespace).Create(ctx, copied, metav1.CreateOptions{})
			require.NoError(t, err)
			if tc.typ == objects.SecretTypeLease { // the API server's field selector keeps others from the counter
				e.lc.Observe(metaOf(copied))
			}

			got, err := e.b.GetLease(ctx, west, resp.LeaseID)
			require.NoError(t, err)
			require.Equal(t, "argo", got.Namespace)
			require.NoError(t, e.b.RevokeLease(ctx, west, resp.LeaseID))
			_, err = e.client.CoreV1().Secrets("argo").Get(ctx, lease.Name, metav1.GetOptions{})
			require.True(t, problem.IsNotFound(err), "the lease is revoked")
			_, err = e.client.CoreV1().Secrets(tc.namespace).Get(ctx, lease.Name, metav1.GetOptions{})
			require.NoError(t, err, "the copy is not the broker's to delete")
		})
	}
}

// leaseFixture creates a lease Secret of west in argo as the broker makes
// them, with the given workload ("" none) and credential.
func leaseFixture(t *testing.T, client *fake.Clientset, id, workload, credential string) *corev1.Secret {
	t.Helper()
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: objects.LeaseSecretPrefix + id, Namespace: "argo", UID: types.UID("uid-" + id),
			Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind, objects.LabelLeaseID: id, objects.LabelPeer: "west"},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: time.Now().Add(time.Hour).UTC().Format(time.RFC3339),
				objects.AnnotationIdentity:  west.Identity, objects.AnnotationSA: "admiralty-source", objects.AnnotationCred: credential,
			},
		},
		Type: objects.SecretTypeLease,
	}
	if workload != "" {
		s.Annotations[objects.AnnotationWorkload] = workload
	}
	created, err := client.CoreV1().Secrets("argo").Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)
	return created
}

func TestAWorkloadGetsAndRevokesOnlyItsOwnLeasesByID(t *testing.T) {
	t.Parallel()
	runner := Caller{Identity: west.Identity, Workload: &workload.Identity{Namespace: "ci", ServiceAccount: "runner"}}
	other := Caller{Identity: west.Identity, Workload: &workload.Identity{Namespace: "ci", ServiceAccount: "deployer"}}
	for _, tc := range []struct {
		name     string
		workload string
		caller   Caller
		found    bool
	}{
		{name: "a workload finds its own lease", workload: "ci/runner", caller: runner, found: true},
		{name: "a workload does not find another workload's lease", workload: "ci/runner", caller: other},
		{name: "a workload does not find a lease the peer took without a workload", workload: "", caller: runner},
		{name: "the peer without a workload finds a workload's lease", workload: "ci/runner", caller: west, found: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := context.Background()
			const id = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
			leaseFixture(t, e.client, id, tc.workload, apiv1.CredentialToken)
			_, err := e.b.GetLease(ctx, tc.caller, id)
			revokeErr := e.b.RevokeLease(ctx, tc.caller, id)
			if tc.found {
				require.NoError(t, err)
				require.NoError(t, revokeErr)
				require.Zero(t, e.leaseCount(t))
				return
			}
			require.Equal(t, problem.KindNotFound, problem.KindOf(err))
			require.Equal(t, problem.KindNotFound, problem.KindOf(revokeErr))
			require.Equal(t, 1, e.leaseCount(t), "not revoked")
		})
	}
}

func TestARevocationDeletesOnlyARoleBindingTheLeaseOwns(t *testing.T) {
	t.Parallel()
	const id = "bbbbbbbbbbbbbbbbbbbbbbbbbb"
	for _, tc := range []struct {
		name    string
		owners  []metav1.OwnerReference
		deleted bool
	}{
		{name: "the binding the lease owns goes", owners: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Secret", Name: objects.LeaseSecretPrefix + id, UID: "uid-" + id}}, deleted: true},
		{name: "a binding of the lease's name that someone else made stays"},
		{name: "a binding owned by another object of the lease's name stays", owners: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Secret", Name: objects.LeaseSecretPrefix + id, UID: "uid-earlier"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			client := fake.NewClientset()
			b, err := New(Config{Secrets: client.CoreV1(), RoleBindings: client.RbacV1(), Policy: policy.NewStore(mustPolicy(t, testPolicy)), Logger: zap.NewNop()})
			require.NoError(t, err)
			ctx := context.Background()
			leaseFixture(t, client, id, "", apiv1.CredentialClientCertificate)
			_, err = client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: objects.LeaseSecretPrefix + id, Namespace: "argo", UID: "rb-uid", OwnerReferences: tc.owners},
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "admin"},
			}, metav1.CreateOptions{})
			require.NoError(t, err)

			require.NoError(t, b.RevokeLease(ctx, west, id))
			_, err = client.RbacV1().RoleBindings("argo").Get(ctx, objects.LeaseSecretPrefix+id, metav1.GetOptions{})
			require.Equal(t, tc.deleted, problem.IsNotFound(err), "deleted: %v", err)
		})
	}
}

func TestTheGarbageCollectorLeavesSecretsOfAnotherTypeWithTheLeaseLabels(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	expired := leaseFixture(t, e.client, "cccccccccccccccccccccccccc", "", apiv1.CredentialToken)
	expired.Annotations[objects.AnnotationExpiresAt] = time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
	_, err := e.client.CoreV1().Secrets("argo").Update(ctx, expired, metav1.UpdateOptions{})
	require.NoError(t, err)
	other := forgedSecret(expired, "argo", corev1.SecretTypeOpaque, time.Now())
	other.Name = "someone-elses"
	_, err = e.client.CoreV1().Secrets("argo").Create(ctx, other, metav1.CreateOptions{})
	require.NoError(t, err)

	n, err := e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the expired lease")
	_, err = e.client.CoreV1().Secrets("argo").Get(ctx, "someone-elses", metav1.GetOptions{})
	require.NoError(t, err, "not the broker's to delete")
}
