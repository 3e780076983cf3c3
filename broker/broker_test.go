package broker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
	"github.com/tokenbroker/tokenbroker/pki"
)

// fakeIssuer stands in for the API server's TokenRequest in pure-logic
// tests; what the API server decides is tested in test/integration.
type fakeIssuer struct {
	mu      sync.Mutex
	err     error
	shorten time.Duration // grant this much less than asked
	delay   time.Duration // answer this late on clock, like a slow API server
	clock   *clocktesting.FakeClock
	cert    *issuers.Credential // issue this client certificate instead of a token
	got     []issuers.Request
	clk     clock.PassiveClock // the issuer's time, if set; else the wall clock
}

const secretToken = "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJqdGktNDIifQ.c2lnbmF0dXJlLXRoYXQtbXVzdC1uZXZlci1iZS1sb2dnZWQ"

func (f *fakeIssuer) Kind() string {
	if f.cert != nil {
		return issuers.KindClientCertificate
	}
	return issuers.KindToken
}

// Limits are those of the TokenRequest issuer.
func (f *fakeIssuer) Limits() issuers.Limits { return tokenrequest.New(nil).Limits() }

func (f *fakeIssuer) Issue(_ context.Context, req issuers.Request) (issuers.Credential, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, req)
	if f.delay > 0 {
		f.clock.Step(f.delay)
	}
	if f.err != nil {
		return issuers.Credential{}, f.err
	}
	if f.cert != nil {
		return *f.cert, nil
	}
	// Whole seconds, like a JWT exp.
	now := time.Now()
	if f.clk != nil {
		now = f.clk.Now()
	}
	return issuers.Credential{Token: secretToken, ExpiresAt: now.Add(req.TTL - f.shorten).Truncate(time.Second)}, nil
}

type env struct {
	b      *Broker
	client *fake.Clientset
	iss    *fakeIssuer
	logs   *observer.ObservedLogs
}

func newEnv(t testing.TB) *env {
	t.Helper()
	core, logs := observer.New(zap.DebugLevel)
	client := fake.NewClientset()
	iss := &fakeIssuer{}
	b, err := New(Config{
		Secrets: client.CoreV1(),
		Issuers: map[string]Issuer{apiv1.CredentialToken: iss},
		Policy:  policy.NewStore(mustPolicy(t, testPolicy)),
		Logger:  zap.New(core),
	})
	require.NoError(t, err)
	return &env{b: b, client: client, iss: iss, logs: logs}
}

var west = Caller{Identity: "spiffe://oc.example/cluster/west"}

func (e *env) leaseCount(t *testing.T) int {
	t.Helper()
	l, err := e.client.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	return len(l.Items)
}

func TestIssueBuildsAWorkingKubeconfigAndABoundLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{
		Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h", Audiences: []string{"aud"},
	})
	require.NoError(t, err)
	require.True(t, apiv1.ValidLeaseID(resp.LeaseID), resp.LeaseID)
	require.Equal(t, "2h0m0s", resp.GrantedTTL)
	require.Empty(t, resp.ClampedBy)

	cfg, err := clientcmd.Load([]byte(resp.Kubeconfig))
	require.NoError(t, err)
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, "https://east.example.com:6443", rc.Host)
	require.Equal(t, secretToken, rc.BearerToken)
	ns, _, err := clientcmd.NewDefaultClientConfig(*cfg, nil).Namespace()
	require.NoError(t, err)
	require.Equal(t, "argo", ns)

	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	s, err := e.client.CoreV1().Secrets("argo").Get(context.Background(), "tokenbroker-lease-"+resp.LeaseID, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "west", s.Labels[objects.LabelPeer])
	require.Equal(t, "JTI=jti-42", s.Annotations[objects.AnnotationCredentialID], "the token's id as the API server logs it")
	require.Equal(t, resp.LeaseID, s.Labels[objects.LabelLeaseID])
	require.NotEmpty(t, s.Annotations[objects.AnnotationExpiresAt])
	require.Len(t, e.iss.got, 1)
	require.Equal(t, "Secret", e.iss.got[0].Lease.Kind)
	require.Equal(t, s.Name, e.iss.got[0].Lease.Name)
	require.Equal(t, []string{"aud"}, e.iss.got[0].Audiences)
}

func TestATTLUnderTheIssuersMinimumIsGrantedAsAskedAndTheLeaseRevokedAtItsExpiry(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, ttl, granted, clampedBy string
	}{
		{"A one-minute ttl is granted one minute, though the token lives the TokenRequest minimum of ten.", "1m", "1m0s", ""},
		{"A five-minute ttl is granted five minutes.", "5m", "5m0s", ""},
		{"A ttl under the lease minimum is raised to one minute, and clampedBy says so.", "1ns", "1m0s", policy.ClampedByLeaseMinimum},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, clk := newLimitsEnv(t, testPolicy)
			e.iss.clk = clk
			resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: tc.ttl})
			require.NoError(t, err)
			require.Equal(t, tc.granted, resp.GrantedTTL)
			require.Equal(t, tc.clampedBy, resp.ClampedBy)
			require.Equal(t, 10*time.Minute, e.iss.got[0].TTL, "the issuer is asked within its limits")
			granted, err := time.ParseDuration(tc.granted)
			require.NoError(t, err)
			expiry := clk.Now().Add(granted)
			require.Equal(t, expiry, resp.ExpiresAt, "the answer says the lease's expiry, not the token's")
			secret, err := e.client.CoreV1().Secrets("argo").Get(context.Background(), "tokenbroker-lease-"+resp.LeaseID, metav1.GetOptions{})
			require.NoError(t, err)
			require.Equal(t, expiry.Format(time.RFC3339), secret.Annotations[objects.AnnotationExpiresAt])

			require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond, "the lease's timer is set")
			clk.Step(granted - time.Second)
			require.Never(t, func() bool { return e.leaseCount(t) == 0 }, 100*time.Millisecond, 10*time.Millisecond, "alive before its expiry")
			clk.Step(time.Second)
			require.Eventually(t, func() bool { return e.leaseCount(t) == 0 }, 5*time.Second, 10*time.Millisecond,
				"revoked at its expiry by its timer, with no GC pass")
		})
	}
}

func TestAClientCertificateCredentialBecomesAKubeconfigUserWithItsSerialAudited(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var auditBuf bytes.Buffer
	e.b.cfg.Auditor = audit.NewLog(&auditBuf)
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "kube client CA"})
	require.NoError(t, err)
	id, err := pki.ClusterIdentity("oc.example", "runner")
	require.NoError(t, err)
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: id})
	require.NoError(t, err)
	leaf, err := pki.ParseCertificatesPEM(kp.CertPEM)
	require.NoError(t, err)
	e.iss.cert = &issuers.Credential{CertificatePEM: kp.CertPEM, KeyPEM: kp.KeyPEM, NotBefore: leaf[0].NotBefore, ExpiresAt: leaf[0].NotAfter}

	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	require.Equal(t, apiv1.CredentialClientCertificate, resp.Credential)
	require.Empty(t, resp.Token)
	require.True(t, resp.ExpiresAt.Before(leaf[0].NotAfter), "the lease's expiry, before the certificate's")
	cfg, err := clientcmd.Load([]byte(resp.Kubeconfig))
	require.NoError(t, err)
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, kp.CertPEM, rc.CertData)
	require.Equal(t, kp.KeyPEM, rc.KeyData)
	require.Empty(t, rc.BearerToken)
	require.Contains(t, auditBuf.String(), `"certificate_serial":"`+leaf[0].SerialNumber.Text(16)+`"`)
	require.NotContains(t, auditBuf.String(), "token_jti")
	// The API server's x509 authenticator logs sha256 of the leaf's DER
	// as the credential id; the audit event and the lease carry the same.
	sum := sha256.Sum256(leaf[0].Raw)
	want := "X509SHA256=" + hex.EncodeToString(sum[:])
	require.Contains(t, auditBuf.String(), `"credential_id":"`+want+`"`)
	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	s, err := e.client.CoreV1().Secrets("argo").Get(context.Background(), "tokenbroker-lease-"+resp.LeaseID, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, want, s.Annotations[objects.AnnotationCredentialID])
}

func TestFailedIssuanceLeavesNoLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.iss.err = errors.New("connection refused")
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
	require.Zero(t, e.leaseCount(t))
}

func TestCancelledRequestStillDeletesItsLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	e.iss.err = context.Canceled
	cancel()
	// The fake clientset ignores ctx for Create, so the lease is created; the
	// cleanup must not use the cancelled context.
	_, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Error(t, err)
	require.Zero(t, e.leaseCount(t))
}

func TestAShortenedGrantBelowMinTTLIsRefusedAndLeavesNoLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.iss.shorten = time.Hour
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{
		Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h", MinTTL: "90m",
	})
	require.Equal(t, problem.KindUnprocessable, problem.KindOf(err))
	require.Zero(t, e.leaseCount(t))
}

func TestAShortenedGrantIsReportedAndRecorded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.iss.shorten = time.Hour
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{
		Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h",
	})
	require.NoError(t, err)
	require.Equal(t, policy.ClampedByAPIServer, resp.ClampedBy)
	require.Equal(t, "1h0m0s", resp.GrantedTTL)
	l, err := e.b.GetLease(context.Background(), west, resp.LeaseID)
	require.NoError(t, err)
	require.WithinDuration(t, resp.ExpiresAt, l.ExpiresAt, 2*time.Second)
}

func TestTheTokenIsNeverLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	require.NoError(t, e.b.RevokeLease(context.Background(), west, resp.LeaseID))
	require.NotZero(t, e.logs.Len())
	var sawJTI bool
	for _, entry := range e.logs.All() {
		for k, v := range entry.ContextMap() {
			s, _ := v.(string)
			require.NotContains(t, s, "c2lnbmF0dXJl", "field %s holds the token", k)
			if k == "token_jti" && s == "jti-42" {
				sawJTI = true
			}
		}
		require.NotContains(t, entry.Message, "c2lnbmF0dXJl")
	}
	require.True(t, sawJTI, "the decision log names the token's jti")
}

func TestDeniedRequestsCreateNothingAndAreLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "kube-system", ServiceAccount: "admin"})
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	require.Zero(t, e.leaseCount(t))
	require.Empty(t, e.iss.got)
	denied := e.logs.FilterMessage("decision").FilterField(zap.Bool("allowed", false))
	require.Equal(t, 1, denied.Len())
}

func TestInvalidTTLIsRejectedBeforeAnythingHappens(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, ttl := range []string{"-1h", "0s", "1d", "1e9h", "soon"} {
		_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: ttl})
		require.Equal(t, problem.KindInvalid, problem.KindOf(err), ttl)
	}
	require.Zero(t, e.leaseCount(t))
}

func TestAPeerSeesAndRevokesOnlyItsOwnLeases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	mine, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	// A second peer with a token grant for the same ServiceAccount.
	p := mustPolicy(t, testPolicy+`
  - name: south
    identity: spiffe://oc.example/cluster/south
    grants:
      - {namespaces: [argo], serviceAccounts: [admiralty-source]}
`)
	e.b.cfg.Policy.Store(p)
	south := Caller{Identity: "spiffe://oc.example/cluster/south"}
	theirs, err := e.b.IssueKubeconfig(ctx, south, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)

	list, err := allLeases(ctx, e.b, west)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, mine.LeaseID, list[0].ID)

	_, err = e.b.GetLease(ctx, west, theirs.LeaseID)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(ctx, west, theirs.LeaseID)))
	require.Equal(t, 2, e.leaseCount(t))

	require.NoError(t, e.b.RevokeLease(ctx, west, mine.LeaseID))
	require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(ctx, west, mine.LeaseID)))
	require.Equal(t, 1, e.leaseCount(t))
}

func TestLeaseIDsOfAnyOtherShapeAreNotLookedUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, id := range []string{"", "../../etc/passwd", strings.Repeat("a", 27), "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxy1", "a,b"} {
		_, err := e.b.GetLease(context.Background(), west, id)
		require.Equal(t, problem.KindNotFound, problem.KindOf(err), id)
	}
	require.Empty(t, e.client.Actions())
}

func TestGarbageCollectionDeletesOnlyExpiredLeases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	_, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "10m"})
	require.NoError(t, err)
	keep, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h"})
	require.NoError(t, err)

	n, err := e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	e.b.cfg.Clock = clocktesting.NewFakeClock(time.Now().Add(11 * time.Minute))
	n, err = e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	list, err := allLeases(ctx, e.b, west)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, keep.LeaseID, list[0].ID)
}

func TestOwnTimeExcludesTheWaitOnTheAPIServer(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	clock := clocktesting.NewFakeClock(time.Now())
	e.b.cfg.Clock = clock
	// An API server that takes its time: 30ms for the token, 5ms for the
	// lease Secret, on the broker's clock, so that nothing else passes.
	e.iss.clock, e.iss.delay = clock, 30*time.Millisecond
	e.client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		clock.Step(5 * time.Millisecond)
		return false, nil, nil
	})
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)

	own := histogramSum(t, reg, "tokenbroker_issuance_own_seconds")
	total := histogramSum(t, reg, "tokenbroker_issuance_duration_seconds")
	require.InDelta(t, 0.035, total, 1e-9, "the request took the API server's 35ms")
	require.InDelta(t, 0, own, 1e-9, "the 35ms inside the API calls are API wait, not the broker's own time")
}

func histogramSum(t testing.TB, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetHistogram().GetSampleSum()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func TestALeaseThatCannotBeDeletedDuringAnOutageIsDeletedWhenTheAPIServerIsBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var mu sync.Mutex
	down := true
	e.client.PrependReactor("delete", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if down {
			return true, nil, errors.New("dial tcp 127.0.0.1:6443: connect: connection refused")
		}
		return false, nil, nil
	})
	e.iss.err = errors.New("dial tcp 127.0.0.1:6443: connect: connection refused")
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
	require.Equal(t, 1, e.leaseCount(t), "the outage keeps the lease for now")

	mu.Lock()
	down = false
	mu.Unlock()
	require.Eventually(t, func() bool { return e.leaseCount(t) == 0 }, 10*time.Second, 50*time.Millisecond,
		"the background retry deletes the lease once the API server answers")
}
