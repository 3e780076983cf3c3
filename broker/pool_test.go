package broker

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers/leasecert"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The pool's bookkeeping around the API server, with the fake clientset;
// test/integration/pool_test.go runs it against a real kube-apiserver
// (bound-object revocation, the GC of a crashed claim).

type poolEnv struct {
	b      *Broker
	client *fake.Clientset
	iss    *fakeIssuer
	clock  *clocktesting.FakeClock
}

func newPoolEnv(t *testing.T, cfg lease.PoolConfig) *poolEnv {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Now())
	client := fake.NewClientset()
	iss := &fakeIssuer{}
	b, err := New(Config{
		Secrets: client.CoreV1(),
		Issuers: map[string]Issuer{apiv1.CredentialToken: iss},
		Policy:  policy.NewStore(mustPolicy(t, testPolicy)),
		Logger:  zap.NewNop(),
		Clock:   clk,
		Pool:    cfg,
	})
	require.NoError(t, err)
	if b.pool != nil {
		b.pool.SetRunning(true) // as RunPool does; the tests tend it by hand
	}
	return &poolEnv{b: b, client: client, iss: iss, clock: clk}
}

func (e *poolEnv) secrets(t *testing.T, kind string) []corev1.Secret {
	t.Helper()
	l, err := e.client.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{
		LabelSelector: labels.Set{objects.LabelKind: kind}.String()})
	require.NoError(t, err)
	return l.Items
}

var poolRequest = apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h"}

func TestAPooledIssuanceIsALeaseLikeAnyOther(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 3})
	ctx := context.Background()

	first, err := e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.NoError(t, err)
	require.Empty(t, e.secrets(t, objects.PoolKind), "the first issuance in a namespace is sequential")

	e.clock.Step(lease.PoolQuiet)
	e.b.poolKeeper().Tend(ctx)
	pooled := e.secrets(t, objects.PoolKind)
	require.Len(t, pooled, 3, "the namespace asked for a pool")
	for _, s := range pooled {
		require.Equal(t, "argo", s.Namespace)
		exp, err := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt])
		require.NoError(t, err)
		require.WithinDuration(t, e.clock.Now().Add(lease.PoolDeadline), exp, time.Second, "a claim deadline the GC enforces")
		require.Empty(t, s.Labels[objects.LabelLeaseID])
	}
	page, err := e.b.ListLeases(ctx, west, lease.PageRequest{})
	require.NoError(t, err)
	require.Len(t, page.Items, 1, "pooled Secrets are no leases")

	second, err := e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.NoError(t, err)
	require.Len(t, e.secrets(t, objects.PoolKind), 2, "one was claimed")
	got := e.iss.got[len(e.iss.got)-1]
	require.Equal(t, objects.LeaseSecretPrefix+second.LeaseID, got.Lease.Name, "the token is bound to the claimed Secret")
	var claimedFromPool bool
	for _, s := range pooled {
		claimedFromPool = claimedFromPool || s.Name == got.Lease.Name
	}
	require.True(t, claimedFromPool)

	leases := e.secrets(t, objects.LeaseKind)
	require.Len(t, leases, 2)
	for _, s := range leases {
		if s.Labels[objects.LabelLeaseID] != second.LeaseID {
			continue
		}
		require.Equal(t, "west", s.Labels[objects.LabelPeer])
		require.Equal(t, west.Identity, s.Annotations[objects.AnnotationIdentity])
		require.Equal(t, "admiralty-source", s.Annotations[objects.AnnotationSA])
		require.Equal(t, second.ExpiresAt.UTC().Format(time.RFC3339), s.Annotations[objects.AnnotationExpiresAt])
	}
	page, err = e.b.ListLeases(ctx, west, lease.PageRequest{})
	require.NoError(t, err)
	require.Len(t, page.Items, 2)
	require.NoError(t, e.b.RevokeLease(ctx, west, second.LeaseID))
	require.NoError(t, e.b.RevokeLease(ctx, west, first.LeaseID))
	require.Empty(t, e.secrets(t, objects.LeaseKind))
}

func TestAFailedPooledIssuanceDeletesTheClaimedSecret(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 1})
	ctx := context.Background()
	_, err := e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.NoError(t, err)
	e.clock.Step(lease.PoolQuiet)
	e.b.poolKeeper().Tend(ctx)
	require.Len(t, e.secrets(t, objects.PoolKind), 1)

	e.iss.err = errors.New("the API server refused the TokenRequest")
	_, err = e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.Error(t, err)
	require.Empty(t, e.secrets(t, objects.PoolKind), "the pooled Secret is gone")
	require.Len(t, e.secrets(t, objects.LeaseKind), 1, "only the first lease is left")
}

func TestAVanishedPooledSecretFallsBackToTheSequentialPath(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 1})
	ctx := context.Background()
	_, err := e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.NoError(t, err)
	e.clock.Step(lease.PoolQuiet)
	e.b.poolKeeper().Tend(ctx)
	pooled := e.secrets(t, objects.PoolKind)
	require.Len(t, pooled, 1)
	// Another replica's GC, its clock ahead, deleted it.
	require.NoError(t, e.client.CoreV1().Secrets("argo").Delete(ctx, pooled[0].Name, metav1.DeleteOptions{}))

	resp, err := e.b.IssueKubeconfig(ctx, west, poolRequest)
	require.NoError(t, err)
	require.Len(t, e.secrets(t, objects.LeaseKind), 2)
	require.Equal(t, objects.LeaseSecretPrefix+resp.LeaseID, e.iss.got[len(e.iss.got)-1].Lease.Name,
		"the token is bound to the Secret created on the sequential path")
}

func TestThePoolGrowsOnlyWhileIdleAndWithinItsBounds(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 4, Max: 5})
	ctx := context.Background()
	p := e.b.pool
	p.Take("argo", e.clock.Now(), false)
	p.Take("flux", e.clock.Now(), false)

	e.b.activity.Start()
	require.Equal(t, lease.PoolQuiet, e.b.poolKeeper().Tend(ctx), "look again once quiet")
	require.Empty(t, e.secrets(t, objects.PoolKind), "busy: issuances take the sequential path, no extra writes")
	e.b.activity.Done(e.clock.Now())
	require.Equal(t, lease.PoolQuiet, e.b.poolKeeper().Tend(ctx))
	e.clock.Step(lease.PoolQuiet / 2)
	require.Equal(t, lease.PoolQuiet/2, e.b.poolKeeper().Tend(ctx))
	require.Empty(t, e.secrets(t, objects.PoolKind), "an issuance just ended: another may follow at once")

	e.clock.Step(lease.PoolQuiet / 2)
	require.Zero(t, e.b.poolKeeper().Tend(ctx))
	pooled := e.secrets(t, objects.PoolKind)
	require.Len(t, pooled, 5, "Max bounds the pool over all namespaces")
	per := map[string]int{}
	for _, s := range pooled {
		per[s.Namespace]++
	}
	require.Equal(t, map[string]int{"argo": 3, "flux": 2}, per, "filled evenly")

	// Too old to hand out: deleted, and replaced while still wanted.
	e.clock.Step(lease.PoolHandout)
	p.Take("argo", e.clock.Now(), false)
	e.b.poolKeeper().Tend(ctx)
	for _, s := range e.secrets(t, objects.PoolKind) {
		require.Equal(t, "argo", s.Namespace, "flux was idle past poolIdle")
		require.Equal(t, e.clock.Now().Add(lease.PoolDeadline).UTC().Format(time.RFC3339), s.Annotations[objects.AnnotationExpiresAt], "only new ones")
	}
	require.Len(t, e.secrets(t, objects.PoolKind), 4)

	e.clock.Step(lease.PoolIdle)
	e.b.poolKeeper().Tend(ctx)
	require.Empty(t, e.secrets(t, objects.PoolKind), "no token issued in argo for poolIdle: its pool is deleted")
}

func TestStoppingThePoolDeletesItsSecrets(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 2})
	e.b.pool.SetRunning(false)
	e.b.pool.Take("argo", e.clock.Now(), false) // not running: records nothing
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); e.b.RunPool(ctx) }()
	require.Eventually(t, func() bool { return e.b.pool.IsRunning() }, 10*time.Second, time.Millisecond)
	e.b.pool.Take("argo", e.clock.Now(), false)
	e.b.pool.Wake() // as the end of an issuance does
	require.Eventually(t, func() bool { return len(e.secrets(t, objects.PoolKind)) == 2 }, 10*time.Second, time.Millisecond)
	cancel()
	<-done
	require.Empty(t, e.secrets(t, objects.PoolKind))
	require.Nil(t, e.b.pool.Take("argo", e.clock.Now(), false), "a stopped pool hands out nothing")
}

func TestTheGCDeletesWhatTheCounterSawExpireWithoutListingLeases(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: -1})
	ctx := context.Background()
	lc := lease.NewCounter(nil, e.clock, zap.NewNop())
	e.b.cfg.Leases = lc // no informers: synced, fed by hand below
	now := e.clock.Now()
	mk := func(name, kind string, expires time.Time) {
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name,
			Labels:      map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: kind, objects.LabelPeer: "west"},
			Annotations: map[string]string{objects.AnnotationExpiresAt: expires.UTC().Format(time.RFC3339)}}}
		_, err := e.client.CoreV1().Secrets("argo").Create(ctx, s, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	mk("tokenbroker-lease-seen", objects.LeaseKind, now.Add(time.Minute))
	mk("tokenbroker-lease-pool", objects.PoolKind, now.Add(time.Minute))
	mk("tokenbroker-lease-live", objects.LeaseKind, now.Add(time.Hour))
	mk("tokenbroker-lease-unseen", objects.LeaseKind, now.Add(time.Minute))
	lc.Observe(leaseMeta("argo", "tokenbroker-lease-seen", "west", now.Add(time.Minute)))
	pm := leaseMeta("argo", "tokenbroker-lease-pool", "", now.Add(time.Minute))
	pm.Labels[objects.LabelKind] = objects.PoolKind
	lc.Observe(pm)
	lc.Observe(leaseMeta("argo", "tokenbroker-lease-live", "west", now.Add(time.Hour)))
	own, total := lc.Live("west")
	require.Equal(t, 2, own, "a pooled Secret holds no place")
	require.Equal(t, 2, total)

	n, err := e.b.CollectGarbage(ctx) // the first pass lists everything
	require.NoError(t, err)
	require.Zero(t, n)

	e.clock.Step(2 * time.Minute)
	n, err = e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "the expired lease and the pooled Secret past its deadline")
	left := map[string]bool{}
	for _, s := range append(e.secrets(t, objects.LeaseKind), e.secrets(t, objects.PoolKind)...) {
		left[s.Name] = true
	}
	require.Equal(t, map[string]bool{"tokenbroker-lease-live": true, "tokenbroker-lease-unseen": true}, left,
		"a lease the counter does not know waits for a full pass: this one listed nothing")
	own, _ = lc.Live("west")
	require.Equal(t, 1, own)
}

func TestALookupByLeaseIDListsOneNamespace(t *testing.T) {
	t.Parallel()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: -1})
	ctx := context.Background()
	lc := lease.NewCounter(nil, e.clock, zap.NewNop())
	e.b.cfg.Leases = lc
	resp, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "flux", ServiceAccount: "reader"})
	require.NoError(t, err)
	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	e.client.ClearActions()
	l, err := e.b.GetLease(ctx, west, resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, "flux", l.Namespace)
	require.Len(t, e.client.Actions(), 1, "one list, in the lease's namespace: the counter knows the lease it committed")

	// An id the counter has not seen: no list at all, once the wait for
	// another replica's lease is over.
	e.client.ClearActions()
	done := make(chan error, 1)
	go func() {
		_, err := e.b.GetLease(ctx, west, "aaaaaaaaaaaaaaaaaaaaaaaaaa")
		done <- err
	}()
	for {
		select {
		case err := <-done:
			require.Equal(t, problem.KindNotFound, problem.KindOf(err))
			for _, a := range e.client.Actions() {
				require.NotEqual(t, "list", a.GetVerb(), "an unknown id is not searched for")
			}
			return
		default:
			if e.clock.HasWaiters() {
				e.clock.Step(50 * time.Millisecond) // the lookup waits on the fake clock
			}
			runtime.Gosched()
		}
	}
}

// newGatewayPoolEnv is a pool env whose broker issues gateway leases to
// south, signed by a real CA (leasecert), with the writes after an answer
// held until the test runs them.
func newGatewayPoolEnv(t *testing.T) (*poolEnv, *pki.CA, *[]func()) {
	t.Helper()
	e := newPoolEnv(t, lease.PoolConfig{PerNamespace: 2})
	// The API server gives every object a UID, which a lease certificate
	// names; the fake does not.
	e.client.PrependReactor("create", "secrets", func(a k8stesting.Action) (bool, kruntime.Object, error) {
		s := a.(k8stesting.CreateAction).GetObject().(*corev1.Secret)
		s.UID = uuid.NewUUID()
		return false, nil, nil
	})
	e.b.cfg.Policy.Store(mustPolicy(t, gatewayPolicy))
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "pool test CA"})
	require.NoError(t, err)
	e.b.cfg.Gateway = &Gateway{Issuer: &leasecert.Issuer{Signer: ca, Now: e.clock.Now}, Server: "https://gateway.example:8445",
		CAData: func() []byte { return ca.BundlePEM() }}
	held := new([]func())
	e.b.after = lease.NewAfterAnswer(maxWritesAfterAnswers, func(f func()) { *held = append(*held, f) })
	return e, ca, held
}

var gatewayPoolRequest = apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "1h", Access: apiv1.AccessGateway}

// leaseOfKubeconfig is the lease its certificate names.
func leaseOfKubeconfig(t *testing.T, ca *pki.CA, kc string, at time.Time) pki.LeaseName {
	t.Helper()
	cfg, err := clientcmd.Load([]byte(kc))
	require.NoError(t, err)
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	block, _ := pem.Decode(rc.CertData)
	require.NotNil(t, block)
	cert, err := x509.ParseCertificate(block.Bytes)
	require.NoError(t, err)
	n, err := pki.VerifyLeaseCertificate([]*x509.Certificate{cert}, ca.CertPool(), at)
	require.NoError(t, err)
	return n
}

// A gateway lease on a pooled Secret is signed for it and answered before
// any API call; the claim follows the answer, and the namespace's pool is
// refilled at once, busy or not.
func TestAGatewayLeaseOnAPooledSecretIsClaimedAfterItsAnswer(t *testing.T) {
	t.Parallel()
	e, ca, held := newGatewayPoolEnv(t)
	ctx := context.Background()
	_, err := e.b.IssueKubeconfig(ctx, south, gatewayPoolRequest)
	require.NoError(t, err)
	require.Len(t, *held, 0, "the first gateway lease is sequential: nothing follows its answer")

	e.b.activity.Start() // another issuance in flight: a token's refill would wait
	require.Zero(t, e.b.poolKeeper().Tend(ctx), "gateway demand is refilled without waiting for quiet")
	pooled := e.secrets(t, objects.PoolKind)
	require.Len(t, pooled, 2)

	e.client.ClearActions()
	resp, err := e.b.IssueKubeconfig(ctx, south, gatewayPoolRequest)
	require.NoError(t, err)
	require.Empty(t, e.client.Actions(), "answered without an API call")
	n := leaseOfKubeconfig(t, ca, resp.Kubeconfig, e.clock.Now())
	require.Equal(t, resp.LeaseID, n.ID)
	var signedFor *corev1.Secret
	for i := range pooled {
		if pooled[i].Name == objects.LeaseSecretPrefix+resp.LeaseID {
			signedFor = &pooled[i]
		}
	}
	require.NotNil(t, signedFor, "signed for a pooled Secret")
	require.Equal(t, string(signedFor.UID), n.UID)
	require.Len(t, e.secrets(t, objects.PoolKind), 2, "still pooled until the claim runs")

	require.Len(t, *held, 1)
	(*held)[0]()
	leases := e.secrets(t, objects.LeaseKind)
	require.Len(t, leases, 2)
	for _, s := range leases {
		if s.Name != signedFor.Name {
			continue
		}
		require.Equal(t, signedFor.UID, s.UID, "the claim made the pooled Secret the lease")
		require.Equal(t, resp.LeaseID, s.Labels[objects.LabelLeaseID])
		require.Equal(t, "south", s.Labels[objects.LabelPeer])
		require.Equal(t, apiv1.AccessGateway, s.Annotations[objects.AnnotationAccess])
		require.Equal(t, resp.ExpiresAt.UTC().Format(time.RFC3339), s.Annotations[objects.AnnotationExpiresAt])
	}
	require.Zero(t, e.b.poolKeeper().Tend(ctx))
	require.Len(t, e.secrets(t, objects.PoolKind), 2, "refilled at once")
}

// A claim that fails after the answer deletes the pooled Secret, so the
// certificate, good at no gateway meanwhile, never becomes good.
func TestAGatewayLeaseWhoseClaimFailsLeavesNothing(t *testing.T) {
	t.Parallel()
	e, _, held := newGatewayPoolEnv(t)
	ctx := context.Background()
	_, err := e.b.IssueKubeconfig(ctx, south, gatewayPoolRequest)
	require.NoError(t, err)
	e.b.poolKeeper().Tend(ctx)
	require.Len(t, e.secrets(t, objects.PoolKind), 2)

	resp, err := e.b.IssueKubeconfig(ctx, south, gatewayPoolRequest)
	require.NoError(t, err)
	e.client.PrependReactor("patch", "secrets", func(k8stesting.Action) (bool, kruntime.Object, error) {
		return true, nil, errors.New("the API server went away")
	})
	require.Len(t, *held, 1)
	(*held)[0]()
	for _, s := range append(e.secrets(t, objects.PoolKind), e.secrets(t, objects.LeaseKind)...) {
		require.NotEqual(t, objects.LeaseSecretPrefix+resp.LeaseID, s.Name, "the pooled Secret it was signed for is gone")
	}
	require.Len(t, e.secrets(t, objects.LeaseKind), 1, "only the first lease")
}
