package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/viper"
	"go.uber.org/zap"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/server"
)

// agentCommandConfig is the typed configuration of "tokenbroker agent":
// where the agent's config file is and how to log. The file itself is
// parsed by the agent package.
type agentCommandConfig struct {
	ConfigFile string
	Log        logConfig
}

// The agent's client-side limit for the source cluster: it reads and
// writes a few Secrets per refresh, so client-go's default would do, but
// the burst at start (three requests per Secret output) should not queue
// for long: 16 targets fit the burst, and 100 are all written 12.5 s after
// the start (docs/agent.md, "Measured").
const (
	agentKubeQPS   = 20
	agentKubeBurst = 50
)

func newAgentCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "agent --config agent.yaml",
		Short: "Run the agent: keep kubeconfigs from the brokers fresh in this (source) cluster",
		Long: `Run the agent in a source cluster, as a Deployment or a sidecar.

For each target in the config file the agent asks the target's broker for a
kubeconfig (POST /v1/kubeconfigs over mutual TLS), writes it to every output
(a Secret in Admiralty, Argo CD, Flux or plain kubeconfig format, or a file
written atomically with mode 0600), and refreshes it at refresh.fraction
(default 2/3) of the granted lifetime, with jitter. A failed refresh is
retried with capped exponential backoff and never touches the outputs; the
replaced lease is revoked refresh.revokeGrace after its successor reached
every output. Outputs are written only when their content changes.

The agent's client certificate lives in identity.dir or identity.secret; on
first start without one it enrolls with the join token in
identity.enroll.tokenFile, and it renews the certificate at identity.renewAt
of its lifetime.

/healthz, /readyz and /metrics are served on opsAddress (default :9091).
SIGTERM stops the agent gracefully: writes in flight finish, and the current
leases are left alone so that consumers keep working.

--config may also be given as $TOKENBROKER_CONFIG, the log flags as
$TOKENBROKER_LOG_LEVEL and $TOKENBROKER_LOG_FORMAT. See agent/config.go or the
guides in docs/guides for the file format.`,
		Example: `  tokenbroker agent --config /etc/tokenbroker/agent.yaml

  # agent.yaml: one target, an Admiralty Secret and a file
  identity:
    secret: {namespace: tokenbroker-agent, name: agent-identity}
    enroll:
      broker: https://east.example.com:8444
      caFingerprint: sha256:3f1c...
      tokenFile: /var/run/tokenbroker/join/token
  targets:
    - name: east
      broker: https://east.example.com:8443
      request: {namespace: argo, serviceAccount: admiralty-source, ttl: 12h, minTTL: 1h}
      outputs:
        - secret: {namespace: admiralty, name: east, format: admiralty}
        - file: {path: /shared/east.kubeconfig}`,
		Args: cobra.NoArgs,
		RunE: runE(newFlagViper, agentCommandConfigFrom, func(cmd *cobra.Command, cfg agentCommandConfig) error {
			return withLogger(cfg.Log, func(log *zap.Logger) error { return runAgent(cmd.Context(), cfg, log) })
		}),
	}
	cmd.Flags().String("config", "", "the agent's config file (YAML): identity, refresh settings, targets and their outputs (required)")
	addLogFlags(cmd.Flags(), "json")
	return cmd
}

func agentCommandConfigFrom(v *viper.Viper) (agentCommandConfig, error) {
	cfg := agentCommandConfig{ConfigFile: v.GetString("config"), Log: logConfigFrom(v)}
	if cfg.ConfigFile == "" {
		return cfg, errors.New("--config is required (or $TOKENBROKER_CONFIG)")
	}
	return cfg, nil
}

// runAgent is the composition root of the agent.
func runAgent(ctx context.Context, cfg agentCommandConfig, log *zap.Logger) error {
	acfg, err := config.Load(cfg.ConfigFile)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	deps := agent.Deps{Logger: log, Registry: reg}
	if acfg.UsesKubernetes() {
		rc, err := restConfig(acfg.Kubeconfig, "")
		if err != nil {
			return err
		}
		rc.QPS, rc.Burst = agentKubeQPS, agentKubeBurst
		rc.WarningHandler = server.ZapWarnings{Log: log.Named("kubernetes")}
		cs, err := kubernetes.NewForConfig(rc)
		if err != nil {
			return fmt.Errorf("create Kubernetes client: %w", err)
		}
		deps.Kubernetes = cs
		if acfg.UsesClusterProfiles() {
			if deps.Dynamic, err = dynamic.NewForConfig(rc); err != nil {
				return fmt.Errorf("create Kubernetes client: %w", err)
			}
		}
	}
	a, err := agent.New(acfg, deps)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}
