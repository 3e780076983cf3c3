package broker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// tamperPolicy grants west argo and flux, and south argo too: a tenant of
// argo can make west's lease look like south's.
const tamperPolicy = testPolicy + `
  - name: south
    identity: spiffe://oc.example/cluster/south
    grants:
      - {namespaces: [argo], serviceAccounts: [admiralty-source]}
`

type tamperEnv struct {
	b      *Broker
	lc     *lease.Counter
	client *fake.Clientset
	clock  *clocktesting.FakeClock
	audits *auditRecorder
	reg    *prometheus.Registry
}

func newTamperEnv(t *testing.T) *tamperEnv {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Now().Truncate(time.Second))
	lc := lease.NewCounter(nil, clk, zap.NewNop())
	client := fake.NewClientset()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	rec := newAuditRecorder()
	b, err := New(Config{
		Secrets: client.CoreV1(),
		Issuers: map[string]Issuer{apiv1.CredentialToken: &fakeIssuer{}},
		Policy:  policy.NewStore(mustPolicy(t, tamperPolicy)),
		Logger:  zap.NewNop(),
		Clock:   clk,
		Leases:  lc,
		Metrics: m,
		Auditor: rec,
		Pool:    lease.PoolConfig{PerNamespace: -1},
	})
	require.NoError(t, err)
	return &tamperEnv{b: b, lc: lc, client: client, clock: clk, audits: rec, reg: reg}
}

// issue issues west a lease in argo and returns its Secret as the API
// server stores it (a UID, a creation time), which the counter has seen.
func (e *tamperEnv) issue(t *testing.T) (string, *corev1.Secret) {
	t.Helper()
	ctx := context.Background()
	resp, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	s, err := e.client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+resp.LeaseID, metav1.GetOptions{})
	require.NoError(t, err)
	s.UID, s.CreationTimestamp = "genuine", metav1.NewTime(e.clock.Now())
	s, err = e.client.CoreV1().Secrets("argo").Update(ctx, s, metav1.UpdateOptions{})
	require.NoError(t, err)
	e.lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: *s.ObjectMeta.DeepCopy()})
	require.True(t, lease.Intact(s), "the broker's lease bears every mark")
	return resp.LeaseID, s
}

// edit changes the lease s as a tenant who may update Secrets in its
// namespace would, and lets the counter see it.
func (e *tamperEnv) edit(t *testing.T, s *corev1.Secret, change func(*corev1.Secret)) {
	t.Helper()
	s = s.DeepCopy()
	change(s)
	s, err := e.client.CoreV1().Secrets(s.Namespace).Update(context.Background(), s, metav1.UpdateOptions{})
	require.NoError(t, err)
	e.lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: *s.ObjectMeta.DeepCopy()})
}

// tenantEdits are what a tenant who may update Secrets can do to a lease
// to make the broker lose it.
var tenantEdits = map[string]func(*corev1.Secret){
	"its lease-id label stripped":  func(s *corev1.Secret) { delete(s.Labels, objects.LabelLeaseID) },
	"its lease-id label rewritten": func(s *corev1.Secret) { s.Labels[objects.LabelLeaseID] = "bbbbbbbbbbbbbbbbbbbbbbbbbb" },
	"its peer label stripped":      func(s *corev1.Secret) { delete(s.Labels, objects.LabelPeer) },
	"its peer label made south's":  func(s *corev1.Secret) { s.Labels[objects.LabelPeer] = "south" },
	"every label stripped":         func(s *corev1.Secret) { s.Labels = nil },
	"made a pooled Secret":         func(s *corev1.Secret) { s.Labels[objects.LabelKind] = objects.PoolKind },
	"its identity made south's":    func(s *corev1.Secret) { s.Annotations[objects.AnnotationIdentity] = south.Identity },
	"its peer and identity made south's": func(s *corev1.Secret) {
		s.Labels[objects.LabelPeer], s.Annotations[objects.AnnotationIdentity] = "south", south.Identity
	},
}

// Whatever a tenant does to a lease's labels and annotations, its owner
// still gets it and revokes it by id, and nobody else does.
func TestATenantEditedLeaseIsStillRevokedByItsOwnersDelete(t *testing.T) {
	t.Parallel()
	for name, change := range tenantEdits {
		t.Run("a lease with "+name, func(t *testing.T) {
			t.Parallel()
			e := newTamperEnv(t)
			ctx := context.Background()
			id, s := e.issue(t)
			e.edit(t, s, change)

			if _, err := e.b.GetLease(ctx, south, id); err == nil {
				// Only where the edit gave it south's identity: south may
				// then revoke it too, which ends it as its owner would.
				require.Contains(t, name, "identity made south's")
			}
			got, err := e.b.GetLease(ctx, west, id)
			require.NoError(t, err)
			require.Equal(t, id, got.ID, "the id of its name")
			require.NoError(t, e.b.RevokeLease(ctx, west, id))
			_, err = e.client.CoreV1().Secrets("argo").Get(ctx, s.Name, metav1.GetOptions{})
			require.True(t, problem.IsNotFound(err), "revoked: %v", err)

			var revoke *audit.Event
			for _, ev := range e.audits.all() {
				if ev.Action == audit.ActionRevoke && ev.Identity == west.Identity {
					revoke = &ev
				}
			}
			require.NotNil(t, revoke)
			require.Equal(t, audit.DecisionAllow, revoke.Decision)
			require.Equal(t, "west", revoke.Peer, "the caller's peer, not the edited label")
			require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(ctx, west, id)), "gone")
		})
	}
}

// Another peer cannot revoke, or see, a lease a tenant relabelled as
// theirs: the identity the lease was issued to decides.
func TestARelabelledLeaseIsNotAnotherPeersToRevoke(t *testing.T) {
	t.Parallel()
	e := newTamperEnv(t)
	ctx := context.Background()
	id, s := e.issue(t)
	e.edit(t, s, tenantEdits["its peer label made south's"])
	_, err := e.b.GetLease(ctx, south, id)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(ctx, south, id)))
	_, err = e.client.CoreV1().Secrets("argo").Get(ctx, s.Name, metav1.GetOptions{})
	require.NoError(t, err, "still there for west to revoke")
}

// A lease someone else edited is revoked by the next GC pass of a
// replica that saw the edit, as its holder's lease, without any DELETE:
// counted, logged and audited. A copy of its name in another namespace,
// edited too, is someone else's Secret and stays.
func TestTheGCRevokesALeaseSomeoneElseEditedAndNoCopyOfIt(t *testing.T) {
	t.Parallel()
	for name, change := range tenantEdits {
		t.Run("a lease with "+name, func(t *testing.T) {
			t.Parallel()
			e := newTamperEnv(t)
			ctx := context.Background()
			id, s := e.issue(t)
			e.clock.Step(time.Second)
			copied := s.DeepCopy()
			copied.Namespace, copied.UID, copied.ResourceVersion = "flux", "copy", ""
			copied.CreationTimestamp = metav1.NewTime(e.clock.Now())
			copied, err := e.client.CoreV1().Secrets("flux").Create(ctx, copied, metav1.CreateOptions{})
			require.NoError(t, err)
			e.lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: *copied.ObjectMeta.DeepCopy()})
			e.edit(t, copied, change)

			_, err = e.b.CollectGarbage(ctx) // full: the first pass
			require.NoError(t, err)
			_, err = e.client.CoreV1().Secrets("argo").Get(ctx, s.Name, metav1.GetOptions{})
			require.NoError(t, err, "nothing to revoke yet")

			e.edit(t, s, change)
			n, err := e.b.CollectGarbage(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			_, err = e.client.CoreV1().Secrets("argo").Get(ctx, s.Name, metav1.GetOptions{})
			require.True(t, problem.IsNotFound(err), "revoked: %v", err)
			_, err = e.client.CoreV1().Secrets("flux").Get(ctx, s.Name, metav1.GetOptions{})
			require.NoError(t, err, "the copy is not the broker's to delete")
			require.Equal(t, 1.0, metricValue(t, e.reg, "tokenbroker_leases_deleted_total", "reason", "tampered"))

			evs := e.audits.all()
			ev := evs[len(evs)-1]
			require.Equal(t, audit.ActionRevoke, ev.Action)
			require.Equal(t, audit.DecisionAllow, ev.Decision)
			require.Equal(t, west.Identity, ev.Identity, "the holder it was issued to")
			require.Equal(t, "west", ev.Peer)
			require.Equal(t, id, ev.LeaseID)
			require.Equal(t, "argo", ev.Namespace)
			require.Contains(t, ev.Reason, "edited by someone other than the broker")

			n, err = e.b.CollectGarbage(ctx)
			require.NoError(t, err)
			require.Zero(t, n, "revoked once")
		})
	}
}

// The GC never deletes a tampered lease under another UID: a Secret made
// since under its name is someone else's.
func TestTheGCRevokesATamperedLeaseOnlyUnderItsUID(t *testing.T) {
	t.Parallel()
	e := newTamperEnv(t)
	ctx := context.Background()
	// The fake clientset ignores preconditions; the API server refuses a
	// delete whose UID precondition another Secret of the name fails.
	e.client.PrependReactor("delete", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		d := a.(k8stesting.DeleteAction)
		pre := d.GetDeleteOptions().Preconditions
		if pre == nil || pre.UID == nil {
			return false, nil, nil
		}
		cur, err := e.client.Tracker().Get(corev1.SchemeGroupVersion.WithResource("secrets"), d.GetNamespace(), d.GetName())
		if err == nil && cur.(*corev1.Secret).UID != *pre.UID {
			return true, nil, apierrors.NewConflict(corev1.Resource("secrets"), d.GetName(), errors.New("the UID in the precondition does not match"))
		}
		return false, nil, nil
	})
	_, s := e.issue(t)
	e.edit(t, s, tenantEdits["its lease-id label stripped"])
	// Deleted and made again before the GC gets to it; the counter has
	// not seen that yet.
	require.NoError(t, e.client.CoreV1().Secrets("argo").Delete(ctx, s.Name, metav1.DeleteOptions{}))
	again := s.DeepCopy()
	again.UID, again.ResourceVersion = "again", ""
	_, err := e.client.CoreV1().Secrets("argo").Create(ctx, again, metav1.CreateOptions{})
	require.NoError(t, err)
	n, err := e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	got, err := e.client.CoreV1().Secrets("argo").Get(ctx, s.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "again", string(got.UID))
}
