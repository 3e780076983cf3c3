package e2e

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// auditEvents returns the audit events the broker has written so far (its
// stdout, which the e2e harness captures with its log).
func (e *brokerEnv) auditEvents(t *testing.T) []map[string]string {
	t.Helper()
	var out []map[string]string
	sc := bufio.NewScanner(strings.NewReader(e.proc.logs.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var ev map[string]any
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev["audit"] == nil {
			continue
		}
		m := map[string]string{}
		for k, v := range ev {
			if s, ok := v.(string); ok {
				m[k] = s
			}
		}
		out = append(out, m)
	}
	return out
}

// auditEvent waits for the audit event of the request with the given id.
func (e *brokerEnv) auditEvent(t *testing.T, requestID string) map[string]string {
	t.Helper()
	var found map[string]string
	require.Eventually(t, func() bool {
		for _, ev := range e.auditEvents(t) {
			if ev["request_id"] == requestID {
				found = ev
				return true
			}
		}
		return false
	}, 5*time.Second, 20*time.Millisecond, "no audit event for request %s", requestID)
	return found
}

// testAuditTrail checks, against a running broker, the audit trail that
// docs/operations.md tells an operator to read: one event per decision,
// naming the peer and the request, and a token_jti that is the credential
// id the API server itself records for every request made with the token.
func testAuditTrail(t *testing.T, e *brokerEnv, kubectl string) {
	west := filepath.Join(e.dir, "west")

	status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner","ttl":"2h"}`, "-H", "X-Request-Id: audit-allow-1")
	require.Equal(t, 201, status, body)
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &resp))

	ev := e.auditEvent(t, "audit-allow-1")
	require.Equal(t, "tokenbroker.io/v1", ev["audit"])
	require.Equal(t, "issue", ev["action"])
	require.Equal(t, "allow", ev["decision"])
	require.Equal(t, "spiffe://e2e.example/cluster/west", ev["identity"])
	require.Equal(t, "west", ev["peer"])
	require.Equal(t, "argo", ev["namespace"])
	require.Equal(t, "runner", ev["service_account"])
	require.Equal(t, resp.LeaseID, ev["lease_id"])
	require.True(t, strings.HasPrefix(ev["cert_sha256"], "sha256:"), ev["cert_sha256"])
	require.NotEmpty(t, ev["token_jti"])

	// The API server names the same credential: what its audit log
	// records as user.extra["authentication.kubernetes.io/credential-id"].
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kc, []byte(resp.Kubeconfig), 0o600))
	out := run(t, kubectl, "--kubeconfig", kc, "auth", "whoami", "-o", "json")
	var who struct {
		Status struct {
			UserInfo struct {
				Extra map[string][]string `json:"extra"`
			} `json:"userInfo"`
		} `json:"status"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &who), out)
	require.Equal(t, []string{"JTI=" + ev["token_jti"]}, who.Status.UserInfo.Extra["authentication.kubernetes.io/credential-id"])

	status, body = e.postKubeconfig(t, west, `{"namespace":"kube-system","serviceAccount":"runner"}`, "-H", "X-Request-Id: audit-deny-1")
	require.Equal(t, 403, status, body)
	ev = e.auditEvent(t, "audit-deny-1")
	require.Equal(t, "deny", ev["decision"])
	require.Equal(t, "no grant allows this request", ev["reason"])
	require.Empty(t, ev["lease_id"])

	status, body, err := e.curl(t, west, "-X", "DELETE", "-H", "X-Request-Id: audit-revoke-1", "https://"+e.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 204, status, body)
	ev = e.auditEvent(t, "audit-revoke-1")
	require.Equal(t, "revoke", ev["action"])
	require.Equal(t, "allow", ev["decision"])
	require.Equal(t, resp.LeaseID, ev["lease_id"])
	require.Equal(t, "runner", ev["service_account"])

	// The trail never holds the token itself.
	require.NotContains(t, e.proc.logs.String(), resp.Token)
	require.NotContains(t, e.proc.logs.String(), strings.Split(resp.Token, ".")[2])
}
