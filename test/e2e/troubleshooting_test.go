package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const troubleshootingDoc = "docs/troubleshooting.md"

// The log command of docs/troubleshooting.md's recipes; the test feeds them
// the broker's captured log instead.
const (
	docBrokerLogsAll = "kubectl -n tokenbroker logs -l app.kubernetes.io/name=tokenbroker --tail=-1"
	docBrokerLogs    = docBrokerLogsAll + " --since=1h"
	docBrokerLogsDay = docBrokerLogsAll + " --since=24h"
)

// TestTroubleshootingRecipesWorkAsWritten runs the curl, openssl and jq
// commands of docs/troubleshooting.md, with the example host and files
// replaced, against a real broker, and checks that the answers are the ones
// the page shows: the problem+json examples field by field, the TLS alerts,
// /readyz, and the log filters finding the reasons they promise.
func TestTroubleshootingRecipesWorkAsWritten(t *testing.T) {
	for _, tool := range []string{"openssl", "jq"} {
		_, _, err := runErr("sh", "-c", "command -v "+tool)
		require.NoError(t, err, "%s is needed (.ci/run installs it)", tool)
	}
	doc := readDoc(t, troubleshootingDoc)
	ctx := context.Background()
	c := testcluster.Start(t)
	setUpTarget(t, c)
	// The broker's own namespace, where "pki revoke" writes the deny list.
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	e := startBroker(t, c)
	bin := tokenbrokerBinary(t)
	kubectl := kubectlBinary(t)
	pkiDir := filepath.Join(e.dir, "pki")

	// The peer's files under the names the page uses, and a certificate of
	// west that has expired.
	work := t.TempDir()
	for from, to := range map[string]string{
		filepath.Join(e.dir, "west.crt"): "west.crt", filepath.Join(e.dir, "west.key"): "west.key",
		filepath.Join(e.dir, "impostor.crt"): "impostor.crt", filepath.Join(e.dir, "impostor.key"): "impostor.key",
		e.ca: "ca.crt",
	} {
		data, err := os.ReadFile(from)
		require.NoError(t, err)
		writeFile(t, filepath.Join(work, to), string(data))
	}
	past, err := pki.LoadCAWithOptions(filepath.Join(pkiDir, "ca.crt"), filepath.Join(pkiDir, "ca.key"),
		pki.CAOptions{Now: func() time.Time { return time.Now().Add(-48 * time.Hour) }})
	require.NoError(t, err)
	id, err := pki.ClusterIdentity("e2e.example", "west")
	require.NoError(t, err)
	expired, err := past.IssueClient(pki.ClientOptions{Identity: id, Lifetime: time.Hour})
	require.NoError(t, err)
	require.NoError(t, expired.WriteFiles(filepath.Join(work, "expired.crt"), filepath.Join(work, "expired.key")))

	// sh runs lines of the page in work, with the broker's address in
	// place of broker.example and the broker's log in place of kubectl
	// logs; tokenbroker and kubectl are on PATH, KUBECONFIG is the admin's.
	sh := func(t *testing.T, b *brokerEnv, script string, pairs ...string) string {
		t.Helper()
		writeFile(t, filepath.Join(work, "broker.log"), b.proc.logs.String())
		script = replaceAll(t, script, pairs...)
		script = strings.NewReplacer(
			"https://broker.example:8443", "https://"+b.api,
			"broker.example:8443", b.api,
			"http://localhost:9090", "http://"+b.ops,
			docBrokerLogsDay, "cat broker.log",
			docBrokerLogs, "cat broker.log",
			docBrokerLogsAll, "cat broker.log",
		).Replace(script)
		return runShell(t, work, kubectl, c.KubeconfigPath, "PATH="+filepath.Dir(bin)+":$PATH\n"+script)
	}
	block := func(t *testing.T, first string) string {
		t.Helper()
		return fencedBlock(t, doc, "sh", first)
	}

	t.Run("whoami shows the identity and its grants", func(t *testing.T) {
		out := sh(t, e, block(t, "# who am I to the broker, and what may I ask for"))
		var who apiv1.WhoAmI
		require.NoError(t, json.Unmarshal([]byte(out), &who), out)
		require.Equal(t, "spiffe://e2e.example/cluster/west", who.Identity)
		require.Equal(t, "west", who.Peer)
		require.Equal(t, []apiv1.Grant{{Namespaces: []string{"argo"}, ServiceAccounts: []string{"runner"}, MaxTTL: "12h0m0s", Credential: "token"}}, who.Grants)
		// The example answer has the same shape.
		var example apiv1.WhoAmI
		require.NoError(t, json.Unmarshal([]byte(fencedBlock(t, doc, "json", `{"identity":`)), &example))
		require.Equal(t, who.Grants, example.Grants)
	})

	t.Run("a request outside the grants is the 403 the page shows", func(t *testing.T) {
		out := sh(t, e, block(t, "# a request outside the grants: 403"))
		requireDocumentedProblem(t, doc, out, 403)
	})

	t.Run("a minTTL longer than the grant is the 422 the page shows", func(t *testing.T) {
		out := sh(t, e, block(t, "# a minTTL longer than the grant allows: 422"))
		requireDocumentedProblem(t, doc, out, 422)
	})

	t.Run("a granted ServiceAccount that does not exist is the 404 the page shows", func(t *testing.T) {
		pol, err := os.ReadFile(e.policy)
		require.NoError(t, err)
		writeFile(t, e.policy, replaceAll(t, string(pol), "serviceAccounts: [runner]", "serviceAccounts: [runner, ghost]"))
		require.Eventually(t, func() bool {
			status, body, err := e.curl(t, filepath.Join(e.dir, "west"), "https://"+e.api+"/v1/whoami")
			return err == nil && status == 200 && strings.Contains(body, "ghost")
		}, 10*time.Second, 50*time.Millisecond, "the broker never reloaded the policy")
		status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"ghost"}`)
		require.Equal(t, 404, status, body)
		requireDocumentedProblem(t, doc, body, 404)
	})

	t.Run("readyz on the ops port says ok", func(t *testing.T) {
		out := sh(t, e, commandLines(block(t, "kubectl -n tokenbroker get pods -l app.kubernetes.io/name=tokenbroker"), "curl "))
		require.Equal(t, "ok", strings.TrimSpace(out))
	})

	t.Run("openssl shows the alert of each refused certificate, and the log why", func(t *testing.T) {
		check := strings.TrimSpace(block(t, "# the broker's TLS alert, if it refuses the certificate")) + " || true"
		for _, tc := range []struct{ cert, want string }{
			{"west", "HTTP/1.1 200 OK"},
			{"expired", "sslv3 alert certificate expired"},
			{"impostor", "tlsv1 alert unknown ca"},
		} {
			script := check
			if tc.cert != "west" {
				script = replaceAll(t, check, "west.crt", tc.cert+".crt", "west.key", tc.cert+".key")
			}
			out := sh(t, e, script)
			require.Contains(t, out, tc.want, tc.cert)
			require.Contains(t, doc, tc.want[strings.Index(tc.want, "alert ")+len("alert "):], "the page's alert table names it")
		}
		e.requireLog(t, `"reason":"unknown_authority"`)
		out := sh(t, e, block(t, "# refused handshakes, as the broker saw them"))
		require.Contains(t, out, `"reason":"expired"`)
		require.Contains(t, out, `"reason":"unknown_authority"`)
	})

	t.Run("a revoked identity gets the 401 the page shows, and the log says why", func(t *testing.T) {
		rogue := "spiffe://e2e.example/cluster/rogue"
		run(t, bin, "pki", "revoke", "--kubeconfig", c.KubeconfigPath, "--identity", rogue, "--reason", "troubleshooting test")
		var body string
		require.Eventually(t, func() bool {
			var status int
			var err error
			status, body, err = e.curl(t, filepath.Join(e.dir, "rogue"), "https://"+e.api+"/v1/whoami")
			return err == nil && status == 401
		}, 10*time.Second, 50*time.Millisecond)
		requireDocumentedProblem(t, doc, body, 401)
		out := sh(t, e, block(t, "# why a certificate was refused with 401"))
		require.Contains(t, out, "or identity "+rogue+" is revoked")
		require.Contains(t, out, `"identity":"`+rogue+`","cert_sha256":"sha256:`, "the audit trail names the refused certificate")
		require.Contains(t, out, "troubleshooting test", "pki revoke --list shows the entry")
	})

	t.Run("a kubeconfig whose lease was deleted: the token names the lease, the API server refuses it", func(t *testing.T) {
		status, kc := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"runner","ttl":"2h"}`, "-H", "Accept: application/yaml")
		require.Equal(t, 201, status, kc)
		writeFile(t, filepath.Join(work, "kubeconfig"), kc)
		out := sh(t, e, block(t, "# expiry, jti and lease of the token in a kubeconfig"))
		var claims struct{ Expires, JTI, Namespace, Lease string }
		require.NoError(t, json.Unmarshal([]byte(out), &claims), out)
		require.Equal(t, "argo", claims.Namespace)
		require.Regexp(t, `^tokenbroker-lease-[a-z2-7]{26}$`, claims.Lease)
		require.NotEmpty(t, claims.JTI)
		exp, err := time.Parse(time.RFC3339, claims.Expires)
		require.NoError(t, err)
		require.WithinDuration(t, time.Now().Add(2*time.Hour), exp, time.Minute)

		// Revoked by an administrator. The token was never used, so the API
		// server has no cached authentication of it and refuses it at once.
		require.NoError(t, c.Client.CoreV1().Secrets("argo").Delete(ctx, claims.Lease, metav1.DeleteOptions{}))
		var stderr string
		require.Eventually(t, func() bool {
			var err error
			_, stderr, err = runErr(kubectl, "--kubeconfig", filepath.Join(work, "kubeconfig"), "get", "configmaps")
			return err != nil && strings.Contains(stderr, "error: You must be logged in to the server (")
		}, 5*time.Second, 50*time.Millisecond, "kubectl prints what the page says: %s", stderr)

		leaseID := strings.TrimPrefix(claims.Lease, "tokenbroker-lease-")
		out = sh(t, e, block(t, "# the broker's audit events of one lease"), "q3fcxb7kumyz4pa2m6dxx5jnle", leaseID)
		require.Contains(t, out, `"action":"issue"`)
		require.Contains(t, out, `"token_jti":"`+claims.JTI+`"`, "the audit event joins the token on its jti")
	})

	t.Run("the audit and lease queries of operations.md and security.md work on the broker's output", func(t *testing.T) {
		for range 2 {
			status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"runner"}`)
			require.Equal(t, 201, status, body)
		}
		status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"kube-system","serviceAccount":"runner"}`)
		require.Equal(t, 403, status, body)
		ops := readDoc(t, "docs/operations.md")
		queries := fencedBlock(t, ops, "sh", "# every credential issued for argo/runner, with who got it")
		out := sh(t, e, lineAfter(t, queries, "# every credential issued for argo/runner, with who got it"))
		require.Regexp(t, `\{"time":"[^"]+","peer":"west","lease_id":"[a-z2-7]{26}","token_jti":"[^"]+","expires_at":"[^"]+"\}`, out)
		out = sh(t, e, lineAfter(t, queries, "# every refusal, by reason"))
		require.Regexp(t, `\d+ issue deny no grant allows this request`, out)

		security := readDoc(t, "docs/security.md")
		out = sh(t, e, blockContaining(t, security, "[.cert_sha256, .action] | @tsv"),
			"spiffe://oc.example/cluster/west", "spiffe://e2e.example/cluster/west")
		require.Regexp(t, `\d+ sha256:[0-9a-f]{64}\tissue`, out)

		// Revoke every lease of a peer, as the response to a stolen
		// certificate does after revoking the identity.
		require.Equal(t, 2, countLeaseSecrets(t, c, "west"))
		out = sh(t, e, commandLines(blockContaining(t, security, "tokenbroker pki revoke --identity spiffe://oc.example/cluster/west"), "tokenbroker leases "))
		require.Contains(t, out, "argo")
		require.Zero(t, countLeaseSecrets(t, c, "west"))
	})

	t.Run("enrollment refusals: the 401 the page shows, and the log says why", func(t *testing.T) {
		// A broker with the signing CA and the enrollment listener.
		r := *e
		r.api = fmt.Sprintf("127.0.0.1:%d", freePort(t))
		r.ops = fmt.Sprintf("127.0.0.1:%d", freePort(t))
		enroll := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		r.args = append(slices.Clone(e.args), "--ca-cert-file", filepath.Join(pkiDir, "ca.crt"), "--ca-key-file", filepath.Join(pkiDir, "ca.key"),
			"--enroll-address", enroll)
		r.launch(t)

		stdout, stderr, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "north", "--audience", "east")
		require.NoError(t, err, stderr)
		token := writeFile(t, filepath.Join(t.TempDir(), "north.token"), stdout)
		fp := fingerprintRE.FindString(stderr)
		enrollCmd := func(dir string) (string, error) {
			_, stderr, err := runErr(bin, "enroll", "--broker", "https://"+enroll, "--ca-fingerprint", fp, "--token-file", token, "--dir", filepath.Join(t.TempDir(), dir))
			return stderr, err
		}
		out, err := enrollCmd("first")
		require.NoError(t, err, out)
		out, err = enrollCmd("again")
		require.Error(t, err)
		require.Contains(t, out, "401")

		hdr := filepath.Join(t.TempDir(), "headers")
		status, body, err := r.curl(t, "", "-D", hdr, "-H", "Authorization: Bearer not-a-join-token", "-H", "Content-Type: application/json",
			"-d", `{"csr":"x"}`, "https://"+enroll+"/v1/certificates")
		require.NoError(t, err, body)
		require.Equal(t, 401, status, body)
		requireDocumentedProblem(t, doc, body, 401)
		headers, err := os.ReadFile(hdr)
		require.NoError(t, err)
		require.Contains(t, strings.ToLower(string(headers)), `www-authenticate: bearer realm="tokenbroker-enrollment"`)

		r.requireLog(t, "join token already used")
		out = sh(t, &r, block(t, "# why an enrollment was refused"))
		require.Contains(t, out, `"error":"invalid join token: join token already used (record tokenbroker/tokenbroker-jti-`)
		require.Contains(t, out, `"error":"invalid join token: token is malformed`)
		require.Contains(t, out, `"identity":"spiffe://e2e.example/cluster/north"`)

		// The client-CA bundle from the enrollment listener verifies the
		// peer's certificate, as the handshake recipe shows.
		out = sh(t, &r, block(t, "openssl x509 -in west.crt -noout"), "https://broker.example:8444", "https://"+enroll)
		require.Contains(t, out, "URI:spiffe://e2e.example/cluster/west")
		require.Contains(t, out, "west.crt: OK")
	})

	// Last: the API server stays down.
	t.Run("with the API server down, kubeconfigs are the 503 the page shows and readyz says why", func(t *testing.T) {
		require.NoError(t, c.StopAPIServer())
		readyz := commandLines(block(t, "kubectl -n tokenbroker get pods -l app.kubernetes.io/name=tokenbroker"), "curl ")
		var out string
		require.Eventually(t, func() bool {
			out = sh(t, e, readyz)
			return strings.HasPrefix(out, "not ready: API server not ready: ")
		}, 10*time.Second, 100*time.Millisecond, "readyz: %s", out)
		require.Contains(t, doc, "| `not ready: API server not ready: …` |")

		hdr := filepath.Join(t.TempDir(), "headers")
		status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"runner"}`, "-D", hdr)
		require.Equal(t, 503, status, body)
		requireDocumentedProblem(t, doc, body, 503)
		headers, err := os.ReadFile(hdr)
		require.NoError(t, err)
		require.Contains(t, strings.ToLower(string(headers)), "retry-after: 5\r\n")
	})
}

// requireDocumentedProblem checks that body is a problem of the given
// status and that doc shows it: one of the page's ```json examples has the
// same type, title, status, detail and instance.
func requireDocumentedProblem(t *testing.T, doc, body string, status int) {
	t.Helper()
	var got apiv1.Problem
	require.NoError(t, json.Unmarshal([]byte(body), &got), body)
	require.Equal(t, status, got.Status, body)
	require.NotEmpty(t, got.RequestID)
	for _, b := range fencedBlocks(doc, "json") {
		var p apiv1.Problem
		if json.Unmarshal([]byte(b), &p) != nil {
			continue
		}
		if p.Type == got.Type && p.Title == got.Title && p.Status == got.Status && p.Detail == got.Detail && p.Instance == got.Instance {
			return
		}
	}
	t.Fatalf("%s shows no example of this answer; keep it in step:\n%s", troubleshootingDoc, body)
}

// blockContaining returns the ```sh block of doc that contains text,
// without the indentation it has inside a list item.
func blockContaining(t *testing.T, doc, text string) string {
	t.Helper()
	for _, b := range fencedBlocks(doc, "sh") {
		if !strings.Contains(b, text) {
			continue
		}
		lines := strings.Split(b, "\n")
		indent := len(lines[0]) - len(strings.TrimLeft(lines[0], " "))
		for i, l := range lines {
			if len(l) >= indent && strings.TrimSpace(l[:indent]) == "" {
				lines[i] = l[indent:]
			}
		}
		return strings.Join(lines, "\n")
	}
	t.Fatalf("no ```sh block contains %q: the document changed, keep the test in step", text)
	return ""
}

// lineAfter returns the line of block that follows the comment line.
func lineAfter(t *testing.T, block, comment string) string {
	t.Helper()
	lines := strings.Split(block, "\n")
	i := slices.Index(lines, comment)
	require.True(t, i >= 0 && i+1 < len(lines), "no command after %q: the document changed, keep the test in step", comment)
	return lines[i+1] + "\n"
}

// commandLines keeps the lines of a shell block that start with one of
// prefixes: the commands the test can run as written, without the
// cluster-side ones around them (kubectl port-forward).
func commandLines(block string, prefixes ...string) string {
	var keep []string
	for _, l := range strings.Split(block, "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(l, p) {
				keep = append(keep, l)
				break
			}
		}
	}
	return strings.Join(keep, "\n") + "\n"
}
