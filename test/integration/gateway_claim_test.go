package integration

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// freezer holds a replica's writes to lease Secrets (PATCH and DELETE)
// while frozen, as if the replica had stopped between an answer and the
// write that follows it: a held request reaches the API server only once
// thawed, and never if its context ends first.
type freezer struct {
	frozen atomic.Bool
	mu     sync.Mutex
	thaw   chan struct{}
	held   atomic.Int32
}

func newFreezer() *freezer { return &freezer{thaw: make(chan struct{})} }

func (f *freezer) freeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.thaw = make(chan struct{})
	f.frozen.Store(true)
}

func (f *freezer) unfreeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frozen.Store(false)
	close(f.thaw)
}

func (f *freezer) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		if f.frozen.Load() && (r.Method == http.MethodPatch || r.Method == http.MethodDelete) &&
			strings.Contains(r.URL.Path, "/secrets/"+objects.LeaseSecretPrefix) {
			f.mu.Lock()
			thaw := f.thaw
			f.mu.Unlock()
			f.held.Add(1)
			select {
			case <-thaw:
			case <-r.Context().Done():
				return nil, r.Context().Err()
			}
		}
		return rt.RoundTrip(r)
	})
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A gateway lease is answered from a pooled Secret before its claim
// (broker/pool.go). A replica that stops between the two leaves a
// certificate no gateway honours: the Secret it names is no lease. Its
// holder's revocation, at another replica, still ends it for good, and
// the GC deletes such a Secret at its deadline.
func TestAGatewayLeaseAnsweredBeforeItsClaimIsNeverGoodUnlessClaimed(t *testing.T) {
	s, west := setUpGateway(t)
	ctx := context.Background()
	c := s.cluster
	// Replica a writes through a freezer; replica b, of the same CA,
	// does not.
	fr := newFreezer()
	kube := rest.CopyConfig(c.Config)
	kube.WrapTransport = fr.wrap
	a := startStack(t, c, gatewayGrants, withGateway(), withCA(s.ca), withKube(kube))
	b := s
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway}

	// The first gateway lease in argo is sequential and asks a's pool to
	// fill there, at once.
	first := issue(t, a, west, req)
	pooled := func() map[string]string {
		l, err := c.Client.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{LabelSelector: objects.LabelKind + "=" + objects.PoolKind})
		require.NoError(t, err)
		out := map[string]string{}
		for _, sec := range l.Items {
			out[sec.Name] = string(sec.UID)
		}
		return out
	}
	require.Eventually(t, func() bool { return len(pooled()) >= lease.DefaultPoolPerNamespace }, 20*time.Second, 20*time.Millisecond)
	firstClient, aHost := rawGatewayClient(t, first.Kubeconfig)
	require.Eventually(t, func() bool { code, _ := gatewayGet(t, firstClient, aHost); return code == http.StatusOK }, 20*time.Second, 50*time.Millisecond)

	fr.freeze()
	start := time.Now()
	unclaimed := issue(t, a, west, req)
	answered := time.Since(start)
	name := objects.LeaseSecretPrefix + unclaimed.LeaseID
	require.Contains(t, pooled(), name, "answered for a pooled Secret, still unclaimed")
	t.Logf("a gateway lease answered in %s with its claim held", answered)

	// Neither replica's gateway honours its certificate; no listing has it.
	cl, _ := rawGatewayClient(t, unclaimed.Kubeconfig)
	for _, host := range []string{aHost, b.gatewayURL} {
		code, body := gatewayGet(t, cl, host)
		require.Equal(t, http.StatusUnauthorized, code, "%s: %s", host, body)
	}
	var list apiv1.LeaseList
	status, body := do(t, west, http.MethodGet, b.url+"/v1/leases", nil, &list)
	require.Equal(t, http.StatusOK, status, string(body))
	for _, l := range list.Items {
		require.NotEqual(t, unclaimed.LeaseID, l.ID)
	}

	// Its holder revokes it at b: b waits out the claim's bound, then
	// deletes the pooled Secret, so that no claim can land after.
	revoked := time.Now()
	status, body = do(t, west, http.MethodDelete, b.url+"/v1/leases/"+unclaimed.LeaseID, nil, nil)
	require.Equal(t, http.StatusNoContent, status, string(body))
	took := time.Since(revoked)
	require.GreaterOrEqual(t, took, lease.ClaimWait-3*time.Second, "the revocation waited for the claim")
	_, err := c.Client.CoreV1().Secrets("argo").Get(ctx, name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "the pooled Secret is gone: %v", err)
	require.NotZero(t, fr.held.Load(), "a's claim was held")
	t.Logf("the unclaimed lease revoked at the other replica in %s", took)

	// a wakes: its claim, if it is still to come, finds no Secret. The
	// certificate stays refused at both.
	fr.unfreeze()
	for _, host := range []string{aHost, b.gatewayURL} {
		code, body := gatewayGet(t, cl, host)
		require.Equal(t, http.StatusUnauthorized, code, "%s: %s", host, body)
	}

	// A replica gone for good leaves the pooled Secret to the GC, which
	// deletes it at its deadline, claimed or not.
	fr.freeze()
	stranded := issue(t, a, west, req)
	strandedName := objects.LeaseSecretPrefix + stranded.LeaseID
	require.Contains(t, pooled(), strandedName)
	p, err := policy.LoadFile(b.policyFile)
	require.NoError(t, err)
	later, err := broker.New(broker.Config{
		Secrets: c.Client.CoreV1(),
		Policy:  policy.NewStore(p),
		Logger:  zapNop(),
		Clock:   clocktesting.NewFakeClock(time.Now().Add(lease.PoolDeadline + time.Minute)),
	})
	require.NoError(t, err)
	_, err = later.CollectGarbage(ctx)
	require.NoError(t, err)
	require.NotContains(t, pooled(), strandedName, "deleted at its deadline")
	fr.unfreeze()
	code, kept := gatewayGet(t, firstClient, aHost)
	require.Equal(t, http.StatusOK, code, "the claimed lease is kept: %s", kept)

	// A tenant who may edit Secrets relabels the pooled Secrets of a third
	// replica as leases: no certificate is signed for one (the sequential
	// path serves), it is deleted, and a claim on it would fail on its
	// resource version.
	third := startStack(t, c, gatewayGrants, withGateway(), withCA(s.ca))
	_ = issue(t, third, west, req)
	require.Eventually(t, func() bool { return len(pooled()) >= lease.DefaultPoolPerNamespace }, 20*time.Second, 20*time.Millisecond)
	victims := pooled()
	for victim := range victims {
		sec, err := c.Client.CoreV1().Secrets("argo").Get(ctx, victim, metav1.GetOptions{})
		require.NoError(t, err)
		sec.Labels[objects.LabelKind] = objects.LeaseKind
		_, err = c.Client.CoreV1().Secrets("argo").Update(ctx, sec, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	// None of them is pooled any more. (The replicas' keepers may refill
	// the pool meanwhile: new pooled Secrets are no victims.)
	require.Eventually(t, func() bool {
		now := pooled()
		for victim := range victims {
			if _, ok := now[victim]; ok {
				return false
			}
		}
		return true
	}, 20*time.Second, 20*time.Millisecond)
	after := issue(t, third, west, req)
	sec, err := c.Client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+after.LeaseID, metav1.GetOptions{})
	require.NoError(t, err, "a lease of its own")
	require.Equal(t, after.LeaseID, sec.Labels[objects.LabelLeaseID])
	afterClient, _ := rawGatewayClient(t, after.Kubeconfig)
	require.Eventually(t, func() bool { code, _ := gatewayGet(t, afterClient, third.gatewayURL); return code == http.StatusOK }, 20*time.Second, 50*time.Millisecond)
}
