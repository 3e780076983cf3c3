package lease

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// goneRecorder records the counter's OnGone calls.
type goneRecorder struct{ gone []string }

func (g *goneRecorder) record(ns, name string, uid types.UID) {
	g.gone = append(g.gone, ns+"/"+name+"/"+string(uid))
}

// westID is west's identity, as its lease certificates name it.
const westID = "spiffe://oc.example/cluster/west"

// heldLease is the metadata of west's lease "a" in argo as the broker
// writes it (intact: every mark of a lease).
func heldLease(uid types.UID, expires time.Time) *metav1.PartialObjectMetadata {
	m := secretMeta("argo", "tokenbroker-lease-a", "west", expires)
	m.UID = uid
	m.Labels[objects.LabelManagedBy] = objects.ManagedByValue
	m.Labels[objects.LabelLeaseID] = "a"
	m.Annotations[objects.AnnotationIdentity] = westID
	return m
}

// A gateway lease is held while its Secret, under its UID, lives; every
// way it stops being the lease tells the gateway.
func TestTheCounterHoldsALeaseUntilItsSecretGoesInAnyWay(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	exp := now.Add(time.Hour)
	rules := &Rules{Peers: map[string]PeerRule{"west": {Identity: "spiffe://oc.example/cluster/west", Namespaces: map[string]struct{}{"argo": {}}}}}
	setUp := func(t *testing.T) (*Counter, *goneRecorder) {
		lc := NewCounter(nil, clocktesting.NewFakePassiveClock(now), zap.NewNop())
		lc.SetRules(func() *Rules { return rules })
		g := &goneRecorder{}
		lc.OnGone(g.record)
		lc.Observe(heldLease("uid-1", exp))
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.True(t, ok)
		return lc, g
	}

	t.Run("an update under the same UID keeps it", func(t *testing.T) {
		lc, g := setUp(t)
		m := heldLease("uid-1", exp)
		m.Annotations[objects.AnnotationCredentialID] = "X509SHA256=aa"
		lc.Observe(m)
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.True(t, ok)
		require.Empty(t, g.gone)
	})
	t.Run("an edit under the same UID that unmakes it ends it", func(t *testing.T) {
		for name, edit := range map[string]func(m *metav1.PartialObjectMetadata){
			"another identity": func(m *metav1.PartialObjectMetadata) {
				m.Annotations[objects.AnnotationIdentity] = "spiffe://oc.example/cluster/east"
			},
			"a peer the policy lacks": func(m *metav1.PartialObjectMetadata) { m.Labels[objects.LabelPeer] = "nobody" },
			"made a pooled Secret":    func(m *metav1.PartialObjectMetadata) { m.Labels[objects.LabelKind] = objects.PoolKind },
		} {
			t.Run(name, func(t *testing.T) {
				lc, g := setUp(t)
				m := heldLease("uid-1", exp)
				edit(m)
				lc.Observe(m)
				_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
				require.False(t, ok)
				require.Equal(t, []string{"argo/tokenbroker-lease-a/uid-1"}, g.gone, "its open streams end")
			})
		}
	})
	t.Run("a claimed pooled Secret first seen as the lease ends nothing", func(t *testing.T) {
		lc := NewCounter(nil, clocktesting.NewFakePassiveClock(now), zap.NewNop())
		lc.SetRules(func() *Rules { return rules })
		g := &goneRecorder{}
		lc.OnGone(g.record)
		pooled := secretMeta("argo", "tokenbroker-lease-a", "", time.Time{})
		pooled.UID = "uid-1"
		pooled.Labels[objects.LabelKind] = objects.PoolKind
		lc.Observe(pooled)
		require.True(t, lc.Claiming("argo", "tokenbroker-lease-a"))
		place, full := lc.Reserve("west", 10, 10)
		require.Empty(t, full)
		place.Commit("argo", "tokenbroker-lease-a", exp) // answered; the claim follows
		require.True(t, lc.Claiming("argo", "tokenbroker-lease-a"), "counted, but not seen claimed yet")
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.False(t, ok, "no lease until the claim is seen")

		lc.Observe(heldLease("uid-1", exp)) // the claim, seen
		_, ok = lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.True(t, ok)
		require.False(t, lc.Claiming("argo", "tokenbroker-lease-a"))
		require.Empty(t, g.gone, "a lease just made is not reported gone")
	})
	t.Run("another UID under its name is another Secret", func(t *testing.T) {
		lc, g := setUp(t)
		lc.Observe(heldLease("uid-2", exp))
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.False(t, ok)
		require.Equal(t, []string{"argo/tokenbroker-lease-a/uid-1"}, g.gone)
	})
	t.Run("a finalizer does not keep a deleted lease", func(t *testing.T) {
		lc, g := setUp(t)
		m := heldLease("uid-1", exp)
		m.Finalizers = []string{"tenant.example/keep"}
		m.DeletionTimestamp = &metav1.Time{Time: now}
		lc.Observe(m)
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.False(t, ok)
		require.Equal(t, []string{"argo/tokenbroker-lease-a/uid-1"}, g.gone)
		own, _ := lc.Live("west")
		require.Zero(t, own, "nor does it count")
	})
	t.Run("a policy that no longer grants its namespace ends it", func(t *testing.T) {
		lc := NewCounter(nil, clocktesting.NewFakePassiveClock(now), zap.NewNop())
		current := rules
		lc.SetRules(func() *Rules { return current })
		g := &goneRecorder{}
		lc.OnGone(g.record)
		lc.Observe(heldLease("uid-1", exp))
		current = &Rules{Peers: map[string]PeerRule{"west": {Identity: "spiffe://oc.example/cluster/west", Namespaces: map[string]struct{}{}}}}
		lc.Observe(secretMeta("argo", "other", "west", exp)) // any event applies the new rules
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.False(t, ok)
		require.Contains(t, g.gone, "argo/tokenbroker-lease-a/uid-1")
	})
	t.Run("past its recorded expiry it is not held", func(t *testing.T) {
		lc, _ := setUp(t)
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, exp)
		require.False(t, ok)
	})
	t.Run("a certificate of another peer holds nothing", func(t *testing.T) {
		lc, _ := setUp(t)
		for _, id := range []string{"spiffe://oc.example/cluster/east", "west", ""} {
			_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", id, now)
			require.False(t, ok, "the Secret was issued to %s, not %q", westID, id)
		}
	})
	t.Run("nor does a certificate of another peer when the policy verifies everything", func(t *testing.T) {
		lc := NewCounter(nil, clocktesting.NewFakePassiveClock(now), zap.NewNop()) // no rules
		lc.Observe(heldLease("uid-1", exp))
		_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, now)
		require.True(t, ok)
		_, ok = lc.Holds("argo", "tokenbroker-lease-a", "uid-1", "spiffe://oc.example/cluster/east", now)
		require.False(t, ok)
	})
	t.Run("a forged copy in another namespace holds nothing", func(t *testing.T) {
		lc, _ := setUp(t)
		m := heldLease("uid-1", exp)
		m.Namespace = "tenant"
		lc.Observe(m)
		_, ok := lc.Holds("tenant", "tokenbroker-lease-a", "uid-1", westID, now)
		require.False(t, ok, "the policy does not bear out a lease in a namespace it does not grant")
	})
}
