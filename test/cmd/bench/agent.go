package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/tokenbroker/tokenbroker/test/agentscale"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// agentKey is the top-level key of the agent's figures in the results
// file.
const agentKey = "agent"

// agentReport is what bench -agent-targets writes under agentKey.
type agentReport struct {
	*agentscale.Result
	// Setup says how the targets were served, for a reader of the file.
	Setup string `json:"setup"`
	// GoalRSSMB is the goal for the agent's RSS with 100 targets.
	GoalRSSMB float64 `json:"goal_rss_mb"`
	// AgentEnv is what -agent-env added to the agent's environment.
	AgentEnv []string `json:"agent_env,omitempty"`
}

// runAgentBench measures one agent with targets targets served by brokers
// broker processes (see package agentscale), env added to its environment,
// in a harness cluster of its own, prints the figures and writes them under
// agentKey in out, keeping the file's other keys.
func runAgentBench(ctx context.Context, binDir string, targets, brokers int, env []string, out string) error {
	bin, err := tokenbrokerBinary(binDir)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "bench-agent-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	args, auditLog, err := agentscale.AuditArgs(dir)
	if err != nil {
		return err
	}
	c, err := testcluster.Run(ctx, testcluster.WithAPIServerArgs(args...))
	if err != nil {
		return err
	}
	defer c.Stop()
	// The cycle measured must end before the next begins: the agent's
	// client writes at 20 requests/s after a burst of 50, about 3 requests
	// per target at the start, so the last target starts up to 3×targets/20
	// seconds after the first.
	refresh := 15*time.Second + time.Duration(targets)*150*time.Millisecond
	fraction := min(max(refresh.Seconds()/600, 0.02), 0.5)
	fmt.Printf("one agent, %d targets (%d broker URLs on %d broker processes), 10-minute tokens refreshed after %.0f s\n",
		targets, targets, brokers, fraction*600)
	r, err := agentscale.Run(ctx, agentscale.Options{
		Cluster: c, AuditLog: auditLog, Bin: bin, AgentEnv: env, IdleSample: 4 * time.Second, Targets: targets, Brokers: brokers, Fraction: fraction, Dir: dir,
	})
	if err != nil {
		return err
	}
	rep := agentReport{Result: r, GoalRSSMB: 40, AgentEnv: env, Setup: fmt.Sprintf(
		"one harness cluster as source and target; %d tokenbroker serve processes listening on all addresses, each target at its own loopback address (127.1.x.y), "+
			"so the agent has %d broker URLs and clients; per target its own ServiceAccount and output Secret (format kubeconfig); "+
			"the agent as a process with an identity directory and a least-privilege ServiceAccount kubeconfig; "+
			"API calls counted from the kube-apiserver's audit log (the agent's ServiceAccount only), broker calls from tokenbroker_http_requests_total",
		brokers, targets)}
	rep.print()
	if out == "" {
		return nil
	}
	return writeKey(out, agentKey, rep)
}

func (r agentReport) print() {
	calls := func(m map[string]int) string {
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(m)) {
			parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
		}
		return fmt.Sprintf("%d (%s)", agentscale.Total(m), strings.Join(parts, ", "))
	}
	fmt.Printf("first Secret %.0f ms, all %d Secrets %.0f ms after the agent started\n", r.FirstSecretMs, r.Targets, r.AllSecretsMs)
	fmt.Printf("agent RSS (goal < %.0f MB): steady (between cycles) %.1f MB (%.1f MB anonymous, the rest the binary's pages), while refreshing %.1f MB (%.1f MB anonymous), peak %.1f MB\n",
		r.GoalRSSMB, r.RSSSteadyMB, r.RSSSteadyAnonMB, r.RSSRefreshingMB, r.RSSRefreshingAnonMB, r.RSSPeakMB)
	fmt.Printf("agent after the cycle: heap in use %.1f MB, stacks %.1f MB, %d goroutines\n", r.HeapInuseMB, r.StackInuseMB, r.Goroutines)
	fmt.Printf("start-up:  API server calls %s; broker calls %s\n", calls(r.StartupKubeCalls), calls(r.StartupBrokerCalls))
	fmt.Printf("one cycle (%.1f s): API server calls %s; broker calls %s\n", r.CycleSeconds, calls(r.CycleKubeCalls), calls(r.CycleBrokerCalls))
	fmt.Printf("per target per cycle: %.2f API server calls, %.2f broker calls\n", r.KubeCallsPerTarget, r.BrokerCallsPerTarget)
}

// writeKey sets key to v in the JSON object in file (made if missing),
// keeping its other keys, which other modes of bench write.
func writeKey(file, key string, v any) error {
	doc := map[string]json.RawMessage{}
	raw, err := os.ReadFile(file)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return err
	default:
		if err := json.Unmarshal(raw, &doc); err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	doc[key] = b
	out, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return err
	}
	return os.WriteFile(file, append(out, '\n'), 0o644)
}

// splitList splits a comma-separated flag value, dropping empty parts.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
