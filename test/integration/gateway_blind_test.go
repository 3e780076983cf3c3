package integration

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// rawGatewayClient is an HTTP client with a gateway kubeconfig's
// certificate and CA, without client-go's retries (it retries a 503 that
// carries Retry-After), so that every answer is seen.
func rawGatewayClient(t *testing.T, kubeconfig string) (*http.Client, string) {
	t.Helper()
	_, cfg := gatewayClient(t, kubeconfig)
	rt, err := rest.TransportFor(cfg)
	require.NoError(t, err)
	return &http.Client{Transport: rt, Timeout: 10 * time.Second}, cfg.Host
}

// gatewayGet GETs argo's ConfigMaps through the gateway and returns the
// status and body.
func gatewayGet(t *testing.T, c *http.Client, host string) (int, string) {
	t.Helper()
	resp, err := c.Get(host + "/api/v1/namespaces/argo/configmaps")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// A replica whose view of the leases is broken (its watch cut, the API
// server unreachable) does not answer from its memory: within the bound
// it refuses (503) what it cannot confirm, and once the API server answers
// again it serves a live lease and refuses one deleted while it was
// blind, before its watch has caught up.
func TestABlindGatewayRefusesUntilItCanAskAndNeverServesALeaseDeletedMeanwhile(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	ensureNamespace(t, c, "argo")
	_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	user, _ := testcluster.ServiceAccountUser("argo", "runner")
	grantTo(t, c, "runner-configmaps", user, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}})

	// The broker reaches the API server (its lease watch, its rechecks
	// and the requests it forwards) through a proxy the test can cut.
	api, err := url.Parse(c.Config.Host)
	require.NoError(t, err)
	proxy := startCutProxy(t, api.Host)
	kube := rest.CopyConfig(c.Config)
	kube.Host = "https://" + proxy.addr
	s := startStack(t, c, gatewayGrants, withGateway(), withKube(kube))
	west := s.client(t, "west")

	kept := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	doomed := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	keptClient, host := rawGatewayClient(t, kept.Kubeconfig)
	doomedClient, _ := rawGatewayClient(t, doomed.Kubeconfig)
	for _, cl := range []*http.Client{keptClient, doomedClient} {
		require.Eventually(t, func() bool { code, _ := gatewayGet(t, cl, host); return code == http.StatusOK }, 30*time.Second, 50*time.Millisecond)
	}
	rechecks := func(outcome string) float64 {
		return counter(t, s.reg, "tokenbroker_gateway_lease_rechecks_total", map[string]string{"outcome": outcome})
	}
	require.Zero(t, rechecks("live")+rechecks("gone")+rechecks("error"), "a replica that sees asks the API server nothing")

	// Cut: until the counter is blind a request is still forwarded (and
	// fails upstream, 502); then it is refused as unconfirmed.
	proxy.cut()
	cutAt := time.Now()
	var refusedIn time.Duration
	for refusedIn == 0 {
		require.Less(t, time.Since(cutAt), 30*time.Second, "a blind replica refuses what it cannot confirm")
		code, body := gatewayGet(t, keptClient, host)
		require.NotEqual(t, http.StatusOK, code, "nothing can be forwarded through the cut")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "cannot confirm this lease") {
			refusedIn = time.Since(cutAt)
		}
		time.Sleep(20 * time.Millisecond) // a poll, under the deadline above
	}
	t.Logf("the first refusal came %s after the cut (BlindAfter is 3s)", refusedIn.Round(time.Millisecond))
	require.Less(t, refusedIn, 6*time.Second, "refused within the bound, not after a relist's backoff")
	code, _ := gatewayGet(t, keptClient, host)
	require.Equal(t, http.StatusServiceUnavailable, code, "and refused as long as it stays blind")
	require.Positive(t, rechecks("error"))

	// Revoked while the replica cannot see it (as by another replica).
	require.NoError(t, c.Client.CoreV1().Secrets("argo").Delete(ctx, objects.LeaseSecretPrefix+doomed.LeaseID, metav1.DeleteOptions{}))

	proxy.mend(t)
	mendedAt := time.Now()
	code, body := gatewayGet(t, doomedClient, host)
	require.Equal(t, http.StatusUnauthorized, code, "the lease deleted while the replica was blind is refused at once: %s", body)
	require.Contains(t, body, "the lease is revoked or expired")
	require.Eventually(t, func() bool {
		code, _ := gatewayGet(t, keptClient, host)
		return code == http.StatusOK
	}, 30*time.Second, 20*time.Millisecond, "the live lease is served again")
	t.Logf("the live lease was served again %s after the proxy was back", time.Since(mendedAt).Round(time.Millisecond))
	require.Positive(t, rechecks("gone"))
	code, _ = gatewayGet(t, doomedClient, host)
	require.Equal(t, http.StatusUnauthorized, code, "and stays refused")
}
