package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCLIConfigValidateAcceptsTheShippedConfigs runs the real binary's
// "config validate" on the configurations the repository ships.
func TestCLIConfigValidateAcceptsTheShippedConfigs(t *testing.T) {
	t.Parallel()
	bin := tokenbrokerBinary(t)
	root := repoRoot(t)
	for _, tc := range []struct{ file, kind string }{
		{"deploy/base/policy.yaml", "policy"},
		{"deploy/agent/agent.yaml", "agent"},
	} {
		path := filepath.Join(root, tc.file)
		out, stderr, err := runErr(bin, "config", "validate", path)
		require.NoError(t, err, "%s\n%s", out, stderr)
		require.Equal(t, path+": valid "+tc.kind+" config\n", out)
		// With the kind named, too.
		out = run(t, bin, "config", "validate", "--kind", tc.kind, path)
		require.Equal(t, path+": valid "+tc.kind+" config\n", out)
	}
}

// TestCLIConfigValidateAcceptsEveryPolicyInTheDocs validates every policy
// the documentation shows (a YAML block that starts with "cluster:"), so
// that a renamed field fails here. The agent.yaml blocks are checked by
// TestEveryAgentConfigInTheDocsIsAcceptedByTheLoader.
func TestCLIConfigValidateAcceptsEveryPolicyInTheDocs(t *testing.T) {
	t.Parallel()
	bin := tokenbrokerBinary(t)
	n := 0
	for _, doc := range []string{"docs/policy.md", admiraltyGuide, argoCDGuide, fluxGuide, kargoGuide, capsuleGuide, "docs/guides/argo-workflows.md"} {
		for _, block := range fencedBlocks(readDoc(t, doc), "yaml") {
			if !strings.HasPrefix(block, "cluster:") {
				continue
			}
			n++
			file := filepath.Join(t.TempDir(), "policy.yaml")
			require.NoError(t, os.WriteFile(file, []byte(block), 0o600))
			out, stderr, err := runErr(bin, "config", "validate", file)
			require.NoError(t, err, "%s: the policy\n%s\n%s%s", doc, block, out, stderr)
			require.Equal(t, file+": valid policy config\n", out)
		}
	}
	require.GreaterOrEqual(t, n, 2)
}

// TestCLIConfigValidateReportsEveryProblemAndFails checks the output
// format and exit status of the real binary on a broken file of each kind.
func TestCLIConfigValidateReportsEveryProblemAndFails(t *testing.T) {
	t.Parallel()
	bin := tokenbrokerBinary(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		name, content string
		want          []string
	}{
		{"policy.yaml", "cluster: {name: east, server: 'http://x', caData: x}\nttl: {max: 1m}\npeers: [{name: west, identity: spiffe://oc.example/cluster/west, grants: [{namespaces: [argo], serviceAcounts: [a]}]}]\n",
			[]string{"cluster.caData: no PEM certificate in CA bundle", "cluster.server: must be an https:// URL", "peers[0].grants[0].serviceAccounts: must list at least one ServiceAccount",
				`peers[0].grants[0].serviceAcounts: unknown field (did you mean "serviceAccounts"?)`, "ttl.default: must be between 10m0s and ttl.max", "ttl.max: must be at least 10m0s"}},
		{"agent.yaml", "identity: {dir: id}\ntargets: [{name: east, broker: 'https://east.example.com', request: {namespace: argo}, outputs: [{secret: {namespace: argo, name: east, format: helm}}]}]\n",
			[]string{"targets[0].outputs[0].secret.format: unknown format \"helm\"", "targets[0].request.serviceAccount: is required"}},
		{"broker.yaml", "policy-file: p.yaml\ngc-interval: 1ms\nkube-qps: fast\nlisten-adress: ':8443'\n",
			[]string{"gc-interval: must be at least 1s", `kube-qps: must be a number, not the string "fast"`, `listen-adress: unknown key (did you mean "listen-address"?)`}},
	} {
		file := filepath.Join(dir, tc.name)
		require.NoError(t, os.WriteFile(file, []byte(tc.content), 0o600))
		out, stderr, err := runErr(bin, "config", "validate", file)
		require.Error(t, err, out)
		want := make([]string, len(tc.want))
		for i, w := range tc.want {
			want[i] = file + ": " + w
		}
		got := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, got, len(want), out)
		for i := range want {
			require.True(t, strings.HasPrefix(got[i], want[i]), "line %d: %q, want %q", i, got[i], want[i])
		}
		require.Contains(t, stderr, "problem")
	}

	// serve --config refuses the same file.
	_, stderr, err := runErr(bin, "serve", "--config", filepath.Join(dir, "broker.yaml"))
	require.Error(t, err)
	require.Contains(t, stderr, `kube-qps: must be a number, not the string "fast"`)
	require.Contains(t, stderr, `unknown key "listen-adress"`)
}

// TestCLIVersionNamesTheBuild checks "tokenbroker version" of the binary
// make build made: the version first, then what Go recorded of the build.
func TestCLIVersionNamesTheBuild(t *testing.T) {
	t.Parallel()
	bin := tokenbrokerBinary(t)
	out := run(t, bin, "version")
	t.Logf("tokenbroker version:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.True(t, strings.HasPrefix(lines[0], "tokenbroker "), lines[0])
	require.Contains(t, out, "go:          go1.")
	require.Contains(t, out, "platform:")

	js := run(t, bin, "version", "-o", "json")
	var v struct {
		Version, Revision, GoVersion, Platform string
		Dirty                                  bool
	}
	require.NoError(t, json.Unmarshal([]byte(js), &v), js)
	require.Equal(t, strings.TrimPrefix(lines[0], "tokenbroker "), v.Version)
	require.NotEmpty(t, v.GoVersion)
	require.NotEmpty(t, v.Platform)
}
