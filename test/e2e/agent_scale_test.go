package e2e

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/test/agentscale"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestOneAgentWithManyTargetsMakesOnlyTheCallsTheDesignAllows runs one
// agent with 30 targets, each at a broker URL of its own (two broker
// processes), as `make bench-agent` does with 100 but untimed, and holds
// its calls to what docs/agent.md says a target costs. The API server's
// audit log counts the agent's requests; the brokers' metrics count theirs.
//
// Per target with one Secret output: at start, one GET to adopt what the
// output holds, then one POST /v1/kubeconfigs, one GET and one CREATE; at
// each refresh one POST /v1/kubeconfigs, one GET and one UPDATE, and
// revokeGrace later one DELETE /v1/leases/{id}. Nothing is listed or
// watched, so the cost does not grow with what else is in the cluster.
func TestOneAgentWithManyTargetsMakesOnlyTheCallsTheDesignAllows(t *testing.T) {
	t.Parallel()
	const targets = 30
	dir := t.TempDir()
	t.Cleanup(func() {
		// The agent's and the brokers' logs, for the end-of-run scan
		// (read now: the directory goes when the test ends).
		files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
		for _, f := range files {
			raw, err := os.ReadFile(f)
			require.NoError(t, err)
			text := string(raw)
			collectLog("agentscale "+filepath.Base(f)+" ("+t.Name()+")", func() string { return text })
		}
	})
	args, auditLog, err := agentscale.AuditArgs(dir)
	require.NoError(t, err)
	c := testcluster.Start(t, testcluster.WithAPIServerArgs(args...))
	r, err := agentscale.Run(t.Context(), agentscale.Options{
		Cluster: c, AuditLog: auditLog, Bin: tokenbrokerBinary(t),
		// Refreshed after 18 s: every Secret is written well before.
		Targets: targets, Brokers: 2, Fraction: 0.03, Dir: dir,
	})
	require.NoError(t, err)
	t.Logf("%d targets: every Secret written %.0f ms after the start; RSS while refreshing %.1f MB, peak %.1f MB; one cycle: API server %v, brokers %v",
		targets, r.AllSecretsMs, r.RSSRefreshingMB, r.RSSPeakMB, r.CycleKubeCalls, r.CycleBrokerCalls)

	// Run returns once every target was refreshed and every replaced
	// lease revoked, so each count is at least targets; a retry would be
	// one more, and is allowed only where nothing else was needed.
	within := func(what string, got map[string]int, perTarget map[string]int) {
		t.Helper()
		require.Subset(t, slices.Collect(maps.Keys(perTarget)), slices.Collect(maps.Keys(got)), "%s: no other kind of call", what)
		total := 0
		for k, n := range perTarget {
			require.LessOrEqual(t, got[k], n*targets, "%s: %s", what, k)
			total += n * targets
		}
		require.LessOrEqual(t, agentscale.Total(got), total, "%s", what)
	}
	within("start-up, API server", r.StartupKubeCalls, map[string]int{"get": 2, "create": 1})
	within("start-up, brokers", r.StartupBrokerCalls, map[string]int{"POST /v1/kubeconfigs": 1})
	within("one refresh cycle, API server", r.CycleKubeCalls, map[string]int{"get": 1, "update": 1})
	within("one refresh cycle, brokers", r.CycleBrokerCalls, map[string]int{"POST /v1/kubeconfigs": 1, "DELETE /v1/leases/{id}": 1})
	require.EqualValues(t, targets, r.CycleKubeCalls["update"], "each target's Secret is updated once per refresh, never twice")
}
