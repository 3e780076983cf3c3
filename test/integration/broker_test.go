// Package integration tests the broker in this process against a real
// kube-apiserver from the harness: what the API server decides (TokenRequest,
// bound-object revocation, TokenReview, RBAC) is never faked here.
package integration

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const grants = `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner, ghost]
        maxTTL: 12h
`

func setUp(t *testing.T, opts ...testcluster.Option) (*stack, *http.Client) {
	t.Helper()
	c := testcluster.Start(t, opts...)
	ctx := context.Background()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "argo"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	s := startStack(t, c, grants)
	return s, s.client(t, "west")
}

func issue(t *testing.T, s *stack, c *http.Client, req apiv1.KubeconfigRequest) apiv1.KubeconfigResponse {
	t.Helper()
	var resp apiv1.KubeconfigResponse
	status, body := do(t, c, http.MethodPost, s.url+"/v1/kubeconfigs", req, &resp)
	require.Equal(t, http.StatusCreated, status, string(body))
	return resp
}

func review(t *testing.T, c kubernetes.Interface, token string) *authnv1.TokenReviewStatus {
	t.Helper()
	r, err := c.AuthenticationV1().TokenReviews().Create(context.Background(),
		&authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return &r.Status
}

// leaseSecrets lists the broker's Secrets but the unclaimed pooled ones,
// which are no lease (broker/pool.go).
func leaseSecrets(t *testing.T, c kubernetes.Interface) []corev1.Secret {
	t.Helper()
	l, err := c.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelManagedBy + "=" + objects.ManagedByValue + "," + objects.LabelKind + "!=" + objects.PoolKind})
	require.NoError(t, err)
	return l.Items
}

func TestAgainstARealAPIServer(t *testing.T) {
	s, west := setUp(t)

	t.Run("the issued token authenticates as the ServiceAccount", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "2h"})
		st := review(t, s.cluster.Client, resp.Token)
		require.True(t, st.Authenticated, st.Error)
		require.Equal(t, "system:serviceaccount:argo:runner", st.User.Username)
		// The token is bound to the lease Secret.
		require.Contains(t, st.User.Extra["authentication.kubernetes.io/credential-id"], "JTI="+jwtClaims(t, resp.Token)["jti"].(string))
	})

	t.Run("the granted TTL is honoured and reported", func(t *testing.T) {
		before := time.Now()
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "2h"})
		require.Equal(t, "2h0m0s", resp.GrantedTTL)
		require.Empty(t, resp.ClampedBy)
		exp := time.Unix(int64(jwtClaims(t, resp.Token)["exp"].(float64)), 0)
		require.WithinDuration(t, before.Add(2*time.Hour), exp, 10*time.Second)
		require.WithinDuration(t, exp, resp.ExpiresAt, time.Second)
	})

	t.Run("a TTL over the grant is clamped and says so", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "48h"})
		require.Equal(t, "12h0m0s", resp.GrantedTTL)
		require.Equal(t, policy.ClampedByGrant, resp.ClampedBy)
		exp := time.Unix(int64(jwtClaims(t, resp.Token)["exp"].(float64)), 0)
		require.WithinDuration(t, time.Now().Add(12*time.Hour), exp, 10*time.Second)
	})

	t.Run("revoking a lease makes the API server reject the token within 20s", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
		require.True(t, review(t, s.cluster.Client, resp.Token).Authenticated)
		status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
		start := time.Now()
		require.Eventually(t, func() bool {
			return !review(t, s.cluster.Client, resp.Token).Authenticated
		}, 20*time.Second, 100*time.Millisecond)
		t.Logf("token rejected %s after revocation", time.Since(start).Round(time.Millisecond))
		// And with the token itself, as a client would use it.
		cs, err := kubernetes.NewForConfig(s.cluster.TokenConfig(resp.Token))
		require.NoError(t, err)
		_, err = cs.CoreV1().ConfigMaps("argo").List(context.Background(), metav1.ListOptions{})
		require.Error(t, err)
		require.Contains(t, err.Error(), "Unauthorized")
	})

	t.Run("a TokenRequest that fails leaves no lease Secret", func(t *testing.T) {
		before := len(leaseSecrets(t, s.cluster.Client))
		var p apiv1.Problem
		status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs",
			apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "ghost"}, nil)
		require.Equal(t, http.StatusNotFound, status, string(body))
		require.NoError(t, json.Unmarshal(body, &p))
		require.Contains(t, p.Detail, "ServiceAccount argo/ghost not found")
		require.Len(t, leaseSecrets(t, s.cluster.Client), before)

		// An audience the grant does not list is refused before any lease
		// exists (the API server itself would mint it: audiences_test.go).
		status, body = do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs",
			apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Audiences: []string{"nobody"}}, nil)
		require.Equal(t, http.StatusForbidden, status, string(body))
		require.Len(t, leaseSecrets(t, s.cluster.Client), before, string(body))
	})

	t.Run("a peer lists and revokes only its own leases", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
		var list apiv1.LeaseList
		status, _ := do(t, west, http.MethodGet, s.url+"/v1/leases", nil, &list)
		require.Equal(t, http.StatusOK, status)
		ids := map[string]bool{}
		for _, l := range list.Items {
			ids[l.ID] = true
			require.Equal(t, "west", l.Peer)
		}
		require.True(t, ids[resp.LeaseID])

		stranger := s.client(t, "south")
		status, _ = do(t, stranger, http.MethodGet, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
		require.Equal(t, http.StatusNotFound, status)
		status, _ = do(t, stranger, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
		require.Equal(t, http.StatusNotFound, status)
		require.True(t, review(t, s.cluster.Client, resp.Token).Authenticated)
	})

	t.Run("expired leases are collected", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "10m"})
		// A replica eleven minutes later, with the same policy: the GC looks
		// in the namespaces the policy grants.
		p, err := policy.LoadFile(s.policyFile)
		require.NoError(t, err)
		later, err := broker.New(broker.Config{
			Secrets: s.cluster.Client.CoreV1(),
			Policy:  policy.NewStore(p),
			Logger:  zapNop(),
			Clock:   clocktesting.NewFakeClock(time.Now().Add(11 * time.Minute)),
		})
		require.NoError(t, err)
		n, err := later.CollectGarbage(context.Background())
		require.NoError(t, err)
		require.GreaterOrEqual(t, n, 1)
		for _, sec := range leaseSecrets(t, s.cluster.Client) {
			require.NotEqual(t, resp.LeaseID, sec.Labels[objects.LabelLeaseID])
		}
		require.Eventually(t, func() bool {
			return !review(t, s.cluster.Client, resp.Token).Authenticated
		}, 20*time.Second, 100*time.Millisecond)
	})

	t.Run("no log line holds a token", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
		sig := resp.Token[strings.LastIndex(resp.Token, ".")+1:]
		for _, e := range s.logs.All() {
			require.NotContains(t, e.Message, sig)
			for k, v := range e.ContextMap() {
				b, _ := json.Marshal(v)
				require.NotContains(t, string(b), sig, "log field %s", k)
			}
		}
		// The audit log, as shipped, records the issuance without it.
		audit, err := os.ReadFile(s.auditLog)
		require.NoError(t, err)
		require.Contains(t, string(audit), `"lease_id":"`+resp.LeaseID+`"`)
		require.NotContains(t, string(audit), sig)
	})
}

func TestTheAPIServerMayShortenTheToken(t *testing.T) {
	s, west := setUp(t, testcluster.WithMaxTokenExpiration(time.Hour))

	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "3h"})
	require.Equal(t, policy.ClampedByAPIServer, resp.ClampedBy)
	require.Equal(t, "1h0m0s", resp.GrantedTTL)
	require.WithinDuration(t, time.Now().Add(time.Hour), resp.ExpiresAt, 10*time.Second)
	var lease apiv1.Lease
	status, _ := do(t, west, http.MethodGet, s.url+"/v1/leases/"+resp.LeaseID, nil, &lease)
	require.Equal(t, http.StatusOK, status)
	require.WithinDuration(t, resp.ExpiresAt, lease.ExpiresAt, time.Second)

	before := len(leaseSecrets(t, s.cluster.Client))
	var p apiv1.Problem
	status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs",
		apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "3h", MinTTL: "2h"}, nil)
	require.Equal(t, http.StatusUnprocessableEntity, status, string(body))
	require.NoError(t, json.Unmarshal(body, &p))
	require.Contains(t, p.Detail, "the API server granted only")
	require.Len(t, leaseSecrets(t, s.cluster.Client), before, "the refused request left its lease behind")
}

func jwtClaims(t *testing.T, token string) map[string]any {
	t.Helper()
	parts := strings.Split(token, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(raw, &m))
	return m
}

// A credential never outlives what was asked: the TokenRequest API's
// minimum is 10m, so a one-minute lease holds a token whose exp is ten
// minutes away; the broker revokes the lease at its expiry and the API
// server then refuses the token within its ~10 s token cache.
func TestAOneMinuteLeasesTokenWorksAt50sAndIsRefusedBy75s(t *testing.T) {
	s, west := setUp(t)
	start := time.Now()
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "1m"})
	require.Equal(t, "1m0s", resp.GrantedTTL)
	require.Empty(t, resp.ClampedBy)
	require.WithinDuration(t, start.Add(time.Minute), resp.ExpiresAt, 2*time.Second, "expiresAt is the lease's expiry")
	exp := time.Unix(int64(jwtClaims(t, resp.Token)["exp"].(float64)), 0)
	require.WithinDuration(t, start.Add(10*time.Minute), exp, 10*time.Second, "the token's own exp is the TokenRequest minimum")
	var lease apiv1.Lease
	status, _ := do(t, west, http.MethodGet, s.url+"/v1/leases/"+resp.LeaseID, nil, &lease)
	require.Equal(t, http.StatusOK, status)
	require.True(t, lease.ExpiresAt.Equal(resp.ExpiresAt), "the lease records the same expiry: %s, %s", lease.ExpiresAt, resp.ExpiresAt)

	cs, err := kubernetes.NewForConfig(s.cluster.TokenConfig(resp.Token))
	require.NoError(t, err)
	authenticated := func() bool {
		_, err := cs.CoreV1().ConfigMaps("argo").List(context.Background(), metav1.ListOptions{})
		return err == nil || !strings.Contains(err.Error(), "Unauthorized")
	}
	time.Sleep(time.Until(start.Add(50 * time.Second)))
	require.True(t, review(t, s.cluster.Client, resp.Token).Authenticated, "the token works at 50 s")
	require.True(t, authenticated(), "and authenticates a real request")

	require.Eventually(t, func() bool {
		return !review(t, s.cluster.Client, resp.Token).Authenticated && !authenticated()
	}, time.Until(start.Add(75*time.Second)), 250*time.Millisecond, "the token is refused by 75 s")
	t.Logf("token refused %s after issuance", time.Since(start).Round(time.Millisecond))
	for _, sec := range leaseSecrets(t, s.cluster.Client) {
		require.NotEqual(t, resp.LeaseID, sec.Labels[objects.LabelLeaseID], "the lease Secret is gone")
	}
}
