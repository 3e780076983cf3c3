package e2e

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// workloadAudience is the audience east's broker accepts for workload
// tokens, as docs/policy.md suggests naming it.
const workloadAudience = "tokenbroker.east"

// jwksOverlap is the broker's overlap of an uploaded key set in this
// test: short, so that the test sees it end.
const jwksOverlap = 20 * time.Second

// mintToken asks c's API server for a token of ns/sa with aud.
func mintToken(t *testing.T, c *testcluster.Cluster, ns, sa string, aud ...string) string {
	t.Helper()
	exp := int64(600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(t.Context(), sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: aud, ExpirationSeconds: &exp},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	return tr.Status.Token
}

func createServiceAccounts(t *testing.T, c *testcluster.Cluster, ns string, names ...string) {
	t.Helper()
	_, err := c.Client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	for _, n := range names {
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
}

// forge signs claims with west's real service-account key, for tokens its
// API server would never issue.
func forge(t *testing.T, c *testcluster.Cluster, edit func(jwt.MapClaims)) string {
	t.Helper()
	key, err := c.ServiceAccountSigningKey()
	require.NoError(t, err)
	kid, err := pki.KubernetesKeyID(key.Public())
	require.NoError(t, err)
	now := time.Now()
	claims := jwt.MapClaims{
		"iss": c.ServiceAccountIssuer, "aud": []string{workloadAudience}, "sub": "system:serviceaccount:argo:runner",
		"iat": now.Unix(), "nbf": now.Unix(), "exp": now.Add(10 * time.Minute).Unix(), "jti": "forged",
		"kubernetes.io": map[string]any{"namespace": "argo", "serviceaccount": map[string]any{"name": "runner", "uid": "00000000-0000-4000-8000-000000000001"}},
	}
	if edit != nil {
		edit(claims)
	}
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, claims)
	tok.Header["kid"] = kid
	s, err := tok.SignedString(key)
	require.NoError(t, err)
	return s
}

func problemReason(t *testing.T, body string) string {
	t.Helper()
	var p apiv1.Problem
	require.NoError(t, json.Unmarshal([]byte(body), &p), body)
	return p.Reason
}

func TestWorkloadIdentityAcrossTwoClusters(t *testing.T) {
	t.Parallel()
	east, west := startTwoClusters(t)
	setUpTarget(t, east)
	// Both clusters use the default issuer string: only the peer's
	// pinned keys tell their tokens apart.
	require.Equal(t, east.ServiceAccountIssuer, west.ServiceAccountIssuer)
	createServiceAccounts(t, west, "argo", "runner", "other")
	createServiceAccounts(t, east, "ci", "runner")
	// The broker keeps uploaded key sets in its own namespace.
	_, err := east.Client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker"}}, metav1.CreateOptions{})
	require.NoError(t, err)

	e := newBrokerEnv(t, east)
	writeFile(t, e.policy, workloadPolicy(east, west, ""))
	e.launch(t)

	// A workload token before any key set was uploaded: no keys.
	runnerToken := mintToken(t, west, "argo", "runner", workloadAudience)
	body := `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`
	status, out := e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+runnerToken)
	require.Equal(t, 401, status, out)
	require.Equal(t, "no-keys", problemReason(t, out))

	agent := startKeyUploader(t, e, west, "")

	leasesBefore := countLeaseSecrets(t, east, "west")
	var granted string
	require.Eventually(t, func() bool {
		status, granted = e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+runnerToken)
		return status == 201
	}, 30*time.Second, 200*time.Millisecond, "the uploaded keys never verified west's token: %s\n%s", granted, agent.proc.logs.String())
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(granted), &resp))
	leases := leaseList(t, e, "Authorization: Bearer "+runnerToken)
	require.Len(t, leases, 1, "the workload sees its own lease")
	require.Equal(t, "argo/runner", leases[0].Workload)
	lease := getLeaseSecret(t, east, resp.LeaseID)
	require.Equal(t, "argo/runner", lease.Annotations["tokenbroker.io/workload"])
	e.requireLog(t, `"workload":"argo/runner"`)

	// whoami shows the workload and only its grants.
	st, who, err := e.curl(t, filepath.Join(e.dir, "west"), "-H", "Authorization: Bearer "+runnerToken, "https://"+e.api+"/v1/whoami")
	require.NoError(t, err)
	require.Equal(t, 200, st, who)
	var w apiv1.WhoAmI
	require.NoError(t, json.Unmarshal([]byte(who), &w))
	require.Equal(t, &apiv1.WorkloadInfo{Namespace: "argo", ServiceAccount: "runner", UID: w.Workload.UID}, w.Workload)
	require.Len(t, w.Grants, 1)

	t.Run("the peer without a workload token and another workload are forbidden", func(t *testing.T) {
		status, out := e.postKubeconfig(t, filepath.Join(e.dir, "west"), body)
		require.Equal(t, 403, status, out)
		other := mintToken(t, west, "argo", "other", workloadAudience)
		status, out = e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+other)
		require.Equal(t, 403, status, out)
	})

	t.Run("hostile tokens are refused with their reason and create nothing", func(t *testing.T) {
		pubKey, err := west.ServiceAccountSigningKey()
		require.NoError(t, err)
		pubDER, err := x509.MarshalPKIXPublicKey(pubKey.Public())
		require.NoError(t, err)
		kid, err := pki.KubernetesKeyID(pubKey.Public())
		require.NoError(t, err)
		hs256 := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.MapClaims{"iss": west.ServiceAccountIssuer, "aud": workloadAudience, "sub": "system:serviceaccount:argo:runner", "exp": time.Now().Add(time.Hour).Unix()})
		hs256.Header["kid"] = kid
		hsToken, err := hs256.SignedString(pubDER)
		require.NoError(t, err)
		none := jwt.NewWithClaims(jwt.SigningMethodNone, jwt.MapClaims{"iss": west.ServiceAccountIssuer, "aud": workloadAudience, "sub": "system:serviceaccount:argo:runner", "exp": time.Now().Add(time.Hour).Unix()})
		none.Header["kid"] = kid
		noneToken, err := none.SignedString(jwt.UnsafeAllowNoneSignatureType)
		require.NoError(t, err)
		cases := []struct{ name, token, reason string }{
			{"a token of east's issuer, presented by west", mintToken(t, east, "ci", "runner", workloadAudience), pki.TokenUnknownKey},
			{"an expired token", forge(t, west, func(c jwt.MapClaims) {
				c["iat"], c["nbf"], c["exp"] = time.Now().Add(-time.Hour).Unix(), time.Now().Add(-time.Hour).Unix(), time.Now().Add(-10*time.Minute).Unix()
			}), pki.TokenExpired},
			{"a token not valid yet", forge(t, west, func(c jwt.MapClaims) { c["nbf"] = time.Now().Add(10 * time.Minute).Unix() }), pki.TokenNotYetValid},
			{"a token for another audience", mintToken(t, west, "argo", "runner"), pki.TokenWrongAudience},
			{"a year-long token", forge(t, west, func(c jwt.MapClaims) { c["exp"] = time.Now().Add(365 * 24 * time.Hour).Unix() }), pki.TokenTooLongLived},
			{"alg none", noneToken, pki.TokenUnsupportedAlg},
			{"HS256 with the public key as secret", hsToken, pki.TokenUnsupportedAlg},
			{"an unknown kid", func() string {
				tok := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims{"iss": west.ServiceAccountIssuer})
				tok.Header["kid"] = "not-a-known-kid"
				s, err := tok.SignedString(pubKey)
				require.NoError(t, err)
				return s
			}(), pki.TokenUnknownKey},
			{"an oversized token", strings.Repeat("a", pki.MaxWorkloadTokenBytes+1), pki.TokenTooLarge},
			{"garbage", "garbage", pki.TokenMalformed},
		}
		for _, tc := range cases {
			status, out := e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+tc.token)
			require.Equal(t, 401, status, "%s: %s", tc.name, out)
			require.Equal(t, tc.reason, problemReason(t, out), tc.name)
			if len(tc.token) > 20 {
				require.NotContains(t, out, tc.token[:20], "%s: the token is echoed", tc.name)
			}
			require.NotContains(t, e.proc.logs.String(), tc.token, "%s: the token is logged", tc.name)
		}
		require.Equal(t, leasesBefore+1, countLeaseSecrets(t, east, "west"), "no refused token made a lease")
	})

	t.Run("a rotated key is uploaded again and the old one verifies during the overlap only", func(t *testing.T) {
		oldToken := mintToken(t, west, "argo", "runner", workloadAudience)
		require.NoError(t, west.RotateServiceAccountKey(context.Background(), false))
		rotatedAt := time.Now()
		newToken := mintToken(t, west, "argo", "runner", workloadAudience)
		require.Eventually(t, func() bool {
			status, _ := whoamiStatus(t, e, newToken)
			return status == 200
		}, 15*time.Second, 200*time.Millisecond, "the agent never uploaded the new key set\n%s", agent.proc.logs.String())
		status, out := whoamiStatus(t, e, oldToken)
		require.Equal(t, 200, status, "the old key still verifies during the overlap: %s", out)
		require.Less(t, time.Since(rotatedAt), jwksOverlap, "the test was too slow to see the overlap")
		require.Eventually(t, func() bool {
			status, out = whoamiStatus(t, e, oldToken)
			return status == 401
		}, jwksOverlap+15*time.Second, 500*time.Millisecond)
		require.Equal(t, pki.TokenUnknownKey, problemReason(t, out))
		status, out = e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+newToken)
		require.Equal(t, 201, status, out)
	})
}

// workloadPolicy is the policy of east's broker that trusts west's
// workload tokens (keys uploaded by west's agent) for argo/runner, with
// more fields of its workloadIdentity (YAML at its indentation) in extra.
func workloadPolicy(east, west *testcluster.Cluster, extra string) string {
	return fmt.Sprintf(`cluster:
  name: east
  server: %s
  caFile: cluster-ca.crt
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    workloadIdentity:
      issuer: %s
      audiences: [%s]
      jwksFromPeer: true
      jwksOverlap: %s
%s    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
`, east.URL, west.ServiceAccountIssuer, workloadAudience, jwksOverlap, extra)
}

// identityDir writes west's identity directory (tls.crt, tls.key, ca.crt)
// for e's broker and returns it.
func identityDir(t *testing.T, e *brokerEnv) string {
	t.Helper()
	idDir := filepath.Join(t.TempDir(), "identity")
	require.NoError(t, os.MkdirAll(idDir, 0o700))
	for from, to := range map[string]string{"west.crt": "tls.crt", "west.key": "tls.key"} {
		data, err := os.ReadFile(filepath.Join(e.dir, from))
		require.NoError(t, err)
		writeFile(t, filepath.Join(idDir, to), string(data))
	}
	caData, err := os.ReadFile(e.ca)
	require.NoError(t, err)
	writeFile(t, filepath.Join(idDir, "ca.crt"), string(caData))
	return idDir
}

// startKeyUploader starts an agent in west that uploads west's own
// /openid/v1/jwks to e's broker every second, with more fields of its
// jwksUpload (YAML at its indentation) in extra.
func startKeyUploader(t *testing.T, e *brokerEnv, west *testcluster.Cluster, extra string) *agentProc {
	t.Helper()
	agentOps := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity: {dir: %s}
kubeconfig: %s
jwksUpload:
  brokers: ["https://%s"]
  interval: 1s
%sopsAddress: "%s"
`, identityDir(t, e), west.KubeconfigPath, e.api, extra, agentOps))
	agent := startAgent(t, cfg)
	t.Cleanup(func() { stopProcess(t, agent.proc) })
	return agent
}

func whoamiStatus(t *testing.T, e *brokerEnv, token string) (int, string) {
	t.Helper()
	st, out, err := e.curl(t, filepath.Join(e.dir, "west"), "-H", "Authorization: Bearer "+token, "https://"+e.api+"/v1/whoami")
	require.NoError(t, err)
	return st, out
}

func leaseList(t *testing.T, e *brokerEnv, header string) []apiv1.Lease {
	t.Helper()
	st, out, err := e.curl(t, filepath.Join(e.dir, "west"), "-H", header, "https://"+e.api+"/v1/leases")
	require.NoError(t, err)
	require.Equal(t, 200, st, out)
	var l apiv1.LeaseList
	require.NoError(t, json.Unmarshal([]byte(out), &l))
	return l.Items
}

func getLeaseSecret(t *testing.T, c *testcluster.Cluster, id string) *corev1.Secret {
	t.Helper()
	s, err := c.Client.CoreV1().Secrets("argo").Get(t.Context(), "tokenbroker-lease-"+id, metav1.GetOptions{})
	require.NoError(t, err)
	return s
}
