package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// audienceGrants give runner no audiences; relayGrant gives relay one,
// vault.example. The stack starts without relayGrant, a policy any broker
// version loads, so that the refusal is shown on its own.
const (
	audienceGrants = `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
`
	relayGrant = `      - namespaces: [argo]
        serviceAccounts: [relay]
        audiences: [vault.example]
`
)

// reviewFor is a TokenReview of token by a relying party that accepts the
// given audiences.
func reviewFor(t *testing.T, s *stack, token string, audiences ...string) authnv1.TokenReviewStatus {
	t.Helper()
	r, err := s.cluster.Client.AuthenticationV1().TokenReviews().Create(context.Background(),
		&authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token, Audiences: audiences}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return r.Status
}

// TestAudiencesAreThePolicysAgainstARealAPIServer: the API server itself
// mints a token for any audience it is asked for; only the policy stands
// between a peer and a token for a relying party that never sees the lease.
func TestAudiencesAreThePolicysAgainstARealAPIServer(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	ensureNamespace(t, c, "argo")
	for _, sa := range []string{"runner", "relay"} {
		_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	s := startStack(t, c, audienceGrants)
	west := s.client(t, "west")

	t.Run("an audience the grant does not list is refused with 403 problem+json and nothing is created", func(t *testing.T) {
		before := len(leaseSecrets(t, c.Client))
		for _, aud := range [][]string{{"sts.amazonaws.com"}, {"vault.example"}, {"https://kubernetes.default.svc.cluster.local"}} {
			var p apiv1.Problem
			status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs",
				apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Audiences: aud}, nil)
			require.Equal(t, http.StatusForbidden, status, string(body))
			require.NoError(t, json.Unmarshal(body, &p))
			require.Equal(t, http.StatusForbidden, p.Status)
			require.Equal(t, "The policy does not allow this request.", p.Detail, "no more is told than for any refusal")
		}
		require.Len(t, leaseSecrets(t, c.Client), before)
		require.NoError(t, testutil.GatherAndCompare(s.reg, strings.NewReader(`
# HELP tokenbroker_denials_total Refused requests, by action (issue, revoke, enroll, renew, authenticate) and reason code.
# TYPE tokenbroker_denials_total counter
tokenbroker_denials_total{action="issue",reason="audience_not_granted"} 3
`), "tokenbroker_denials_total"))
	})

	t.Run("a request that names no audience gets a token for the API server", func(t *testing.T) {
		resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
		st := reviewFor(t, s, resp.Token)
		require.True(t, st.Authenticated, st.Error)
	})

	t.Run("a listed audience is minted by the API server, only for that audience, and still bound to the lease", func(t *testing.T) {
		s.writePolicy(t, audienceGrants+relayGrant)
		var resp apiv1.KubeconfigResponse
		require.Eventually(t, func() bool { // the policy is reloaded
			status, _ := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs",
				apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "relay", Audiences: []string{"vault.example"}}, &resp)
			return status == http.StatusCreated
		}, 10*time.Second, 50*time.Millisecond)
		require.Equal(t, []any{"vault.example"}, jwtClaims(t, resp.Token)["aud"])
		st := reviewFor(t, s, resp.Token, "vault.example")
		require.True(t, st.Authenticated, st.Error)
		require.Equal(t, "system:serviceaccount:argo:relay", st.User.Username)
		require.Equal(t, []string{"vault.example"}, st.Audiences)
		// Not a credential for the API server itself.
		require.False(t, reviewFor(t, s, resp.Token).Authenticated)

		// Revocation reaches a relying party that asks the TokenReview
		// API; one that verifies the signature alone never learns of it.
		status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
		require.Eventually(t, func() bool {
			return !reviewFor(t, s, resp.Token, "vault.example").Authenticated
		}, 20*time.Second, 100*time.Millisecond)
	})
}
