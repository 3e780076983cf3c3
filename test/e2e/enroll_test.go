package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

var fingerprintRE = regexp.MustCompile(`sha256:[0-9a-f]{64}`)

// TestANewClusterJoinsWithOneTokenAndTwoCommands follows docs/pki.md: the
// CA side makes a join token, the new cluster enrolls with it, and the
// enrolled certificate then works with curl and renews itself.
func TestANewClusterJoinsWithOneTokenAndTwoCommands(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	bin := tokenbrokerBinary(t)
	dir := t.TempDir()
	pkiDir := filepath.Join(dir, "pki")

	// The operator's CA, with an intermediate so the root key can go offline.
	run(t, bin, "pki", "init", "--dir", pkiDir, "--intermediate")
	run(t, bin, "pki", "issue", "server", "--ca-dir", pkiDir, "--ip", "127.0.0.1", "--dns", "localhost")
	writeFile(t, filepath.Join(dir, "cluster-ca.crt"), string(c.CAData))
	pol := writeFile(t, filepath.Join(dir, "policy.yaml"), fmt.Sprintf(`cluster: {name: east, server: %s, caFile: cluster-ca.crt}
peers:
  - name: north
    identity: spiffe://e2e.example/cluster/north
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`, c.URL))
	api, enroll, ops := fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t))
	proc := startProcess(t, bin, "serve",
		"--listen-address", api, "--enroll-address", enroll, "--ops-address", ops,
		"--tls-cert-file", filepath.Join(pkiDir, "server.crt"), "--tls-key-file", filepath.Join(pkiDir, "server.key"),
		"--client-ca-file", filepath.Join(pkiDir, "bundle.crt"),
		"--ca-cert-file", filepath.Join(pkiDir, "ca.crt"), "--ca-key-file", filepath.Join(pkiDir, "ca.key"),
		"--policy-file", pol, "--kubeconfig", c.KubeconfigPath, "--namespace", "default")
	waitReady(t, proc, "http://"+ops+"/readyz")

	// Command 1, on the CA side.
	tokenFile := filepath.Join(dir, "north.token")
	stdout, stderr, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "north", "--audience", "east", "--ttl", "10m")
	require.NoError(t, err, stderr)
	require.Len(t, strings.Split(strings.TrimSpace(stdout), "\n"), 1, "stdout is the token alone")
	require.NoError(t, os.WriteFile(tokenFile, []byte(stdout), 0o600))
	fp := fingerprintRE.FindString(stderr)
	require.NotEmpty(t, fp, "join-token prints the CA fingerprint to pin: %s", stderr)
	require.NotContains(t, stderr, strings.TrimSpace(stdout), "the token goes to stdout only")

	// Command 2, on the new cluster.
	ident := filepath.Join(dir, "north")
	start := time.Now()
	out := run(t, bin, "enroll", "--broker", "https://"+enroll, "--ca-fingerprint", fp, "--token-file", tokenFile, "--dir", ident)
	t.Logf("enrollment (bootstrap, handshakes, CSR, signing) took %s: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
	st, err := os.Stat(filepath.Join(ident, "tls.key"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	t.Run("openssl verifies the issued chain", func(t *testing.T) {
		chain, err := os.ReadFile(filepath.Join(ident, "tls.crt"))
		require.NoError(t, err)
		blocks := strings.SplitAfter(string(chain), "-----END CERTIFICATE-----\n")
		require.GreaterOrEqual(t, len(blocks), 2, "leaf and intermediate")
		leaf := writeFile(t, filepath.Join(t.TempDir(), "leaf.crt"), blocks[0])
		inter := writeFile(t, filepath.Join(t.TempDir(), "inter.crt"), strings.Join(blocks[1:], ""))
		out := run(t, "openssl", "verify", "-purpose", "sslclient", "-CAfile", filepath.Join(ident, "ca.crt"), "-untrusted", inter, leaf)
		require.Contains(t, out, "OK")
	})

	curlAs := func(t *testing.T, args ...string) (int, string) {
		t.Helper()
		body := filepath.Join(t.TempDir(), "body")
		a := append([]string{"-sS", "--cert", filepath.Join(ident, "tls.crt"), "--key", filepath.Join(ident, "tls.key"),
			"--cacert", filepath.Join(ident, "ca.crt"), "-o", body, "-w", "%{http_code}"}, args...)
		code := run(t, "curl", a...)
		b, _ := os.ReadFile(body)
		var status int
		_, _ = fmt.Sscanf(code, "%d", &status)
		return status, string(b)
	}

	t.Run("curl with the enrolled certificate works as docs/pki.md shows", func(t *testing.T) {
		status, body := curlAs(t, "https://"+api+"/v1/whoami")
		require.Equal(t, 200, status, body)
		var who apiv1.WhoAmI
		require.NoError(t, json.Unmarshal([]byte(body), &who))
		require.Equal(t, "spiffe://e2e.example/cluster/north", who.Identity)
		status, body = curlAs(t, "-H", "Content-Type: application/json",
			"-d", `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`, "https://"+api+"/v1/kubeconfigs")
		require.Equal(t, 201, status, body)
	})

	t.Run("the join token cannot be used twice", func(t *testing.T) {
		_, stderr, err := runErr(bin, "enroll", "--broker", "https://"+enroll, "--ca-fingerprint", fp, "--token-file", tokenFile, "--dir", filepath.Join(dir, "again"))
		require.Error(t, err)
		require.Contains(t, stderr, "401")
		_, err = os.Stat(filepath.Join(dir, "again", "tls.key"))
		require.ErrorIs(t, err, os.ErrNotExist, "a failed enrollment writes nothing")
	})

	t.Run("a wrong pinned fingerprint is refused before anything is sent", func(t *testing.T) {
		stdout, _, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "north", "--audience", "east")
		require.NoError(t, err)
		tf := writeFile(t, filepath.Join(t.TempDir(), "t"), stdout)
		wrong := "sha256:" + strings.Repeat("0", 64)
		_, stderr, err := runErr(bin, "enroll", "--broker", "https://"+enroll, "--ca-fingerprint", wrong, "--token-file", tf, "--dir", filepath.Join(dir, "pinned"))
		require.Error(t, err)
		require.Contains(t, strings.ToLower(stderr), "fingerprint")
	})

	t.Run("enrollment and renewal with curl, openssl and jq work as docs/pki.md shows", func(t *testing.T) {
		for _, tool := range []string{"openssl", "jq"} {
			_, _, err := runErr("sh", "-c", "command -v "+tool)
			require.NoError(t, err, "%s is needed (.ci/run installs it)", tool)
		}
		work := t.TempDir()
		token, _, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "north", "--audience", "east")
		require.NoError(t, err)
		writeFile(t, filepath.Join(work, "west.token"), token)
		bundle, err := os.ReadFile(filepath.Join(pkiDir, "bundle.crt"))
		require.NoError(t, err)
		writeFile(t, filepath.Join(work, "bundle.crt"), string(bundle))
		// The docs' commands with their example host and identity replaced.
		script := strings.NewReplacer(
			"https://east.example.com:8444", "https://"+enroll,
			"https://east.example.com:8443", "https://"+api,
			"spiffe://oc.example/cluster/west", "spiffe://e2e.example/cluster/north",
		).Replace(`set -euo pipefail
openssl x509 -in bundle.crt -noout -fingerprint -sha256

# a key and a CSR whose only SAN is the identity (the subject is ignored)
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key \
  -subj "/CN=west" -addext "subjectAltName=URI:spiffe://oc.example/cluster/west" -out west.csr

# the token goes in a header file, not on the command line
printf 'Authorization: Bearer %s\n' "$(cat west.token)" > auth.header
jq -n --rawfile csr west.csr '{csr: $csr}' |
  curl -sS --cacert bundle.crt -H @auth.header -H 'Content-Type: application/json' \
    --data-binary @- https://east.example.com:8444/v1/certificates > enrolled.json
rm auth.header west.token

jq -r .certificate enrolled.json > tls.crt
jq -r .caBundle enrolled.json > ca.crt
curl --fail-with-body --cert tls.crt --key tls.key --cacert ca.crt https://east.example.com:8443/v1/whoami

openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout new.key \
  -subj "/CN=west" -addext "subjectAltName=URI:spiffe://oc.example/cluster/west" -out new.csr
jq -n --rawfile csr new.csr '{csr: $csr}' |
  curl -sS --cert tls.crt --key tls.key --cacert ca.crt -H 'Content-Type: application/json' \
    --data-binary @- https://east.example.com:8443/v1/certificates > renewed.json
jq -e .certificate renewed.json >/dev/null
`)
		docs, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "pki.md"))
		require.NoError(t, err)
		for _, line := range []string{
			`jq -n --rawfile csr west.csr '{csr: $csr}' |`,
			`    --data-binary @- https://east.example.com:8444/v1/certificates > enrolled.json`,
			`    --data-binary @- https://east.example.com:8443/v1/certificates > renewed.json`,
			`printf 'Authorization: Bearer %s\n' "$(cat west.token)" > auth.header`,
		} {
			require.Contains(t, string(docs), line, "docs/pki.md changed: keep this test's copy of its commands in step")
		}
		cmd := exec.Command("bash", "-c", script)
		cmd.Dir = work
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
		require.Contains(t, string(out), `"identity":"spiffe://e2e.example/cluster/north"`)
	})

	t.Run("the certificate renews itself through the mTLS listener", func(t *testing.T) {
		before, err := os.ReadFile(filepath.Join(ident, "tls.crt"))
		require.NoError(t, err)
		run(t, bin, "renew", "--broker", "https://"+api, "--dir", ident)
		after, err := os.ReadFile(filepath.Join(ident, "tls.crt"))
		require.NoError(t, err)
		require.NotEqual(t, string(before), string(after))
		status, body := curlAs(t, "https://"+api+"/v1/whoami")
		require.Equal(t, 200, status, body)
		require.Contains(t, body, "spiffe://e2e.example/cluster/north")
	})
}
