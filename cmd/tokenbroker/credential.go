package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/viper"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/execcred"
)

// credentialConfig is the typed configuration of "tokenbroker credential".
type credentialConfig struct {
	brokerRequest
	// Info is client-go's request (KUBERNETES_EXEC_INFO).
	Info            execcred.ExecInfo
	NoCache         bool
	CacheDir        string
	RefreshFraction float64
	// WorkloadTokenFile is sent as the workload token ("" for none).
	WorkloadTokenFile string
}

func newCredentialCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "credential --broker URL --identity-dir DIR --namespace NS --service-account SA",
		Short: "The kubectl (client-go) exec credential plugin: a token from the broker, cached until its refresh point",
		Long: `An exec credential plugin for kubectl and every client-go program: a kubeconfig
whose user runs this command stays valid while the short-lived token behind it
renews itself. "tokenbroker get kubeconfig --exec" writes such a kubeconfig.

client-go runs the plugin with KUBERNETES_EXEC_INFO (an ExecCredential request
of client.authentication.k8s.io/v1 or v1beta1; without it, as when you run the
command yourself, the answer is v1). The answer on standard output is an
ExecCredential with status.token and status.expirationTimestamp; nothing else
is ever written there.

The token comes from the broker (POST /v1/kubeconfigs, the request of "get
kubeconfig", authenticated with the identity directory: tls.crt, tls.key,
ca.crt) and is cached in --cache-dir, one file per broker, identity, namespace,
ServiceAccount, access mode, audiences, ttl and min-ttl (directory 0700, files 0600; a
directory or file that group or others could read is refused, and so is a
cache directory that is a symbolic link or whose parent another user owns or
everyone may write without the sticky bit). A cached token
is handed out until its refresh point, --refresh-fraction of its granted life
(2/3 by default), and that point is the expirationTimestamp client-go gets, so
long-running programs run the plugin again there. Parallel invocations wait
for one another (a file lock): twenty kubectl commands at once make one lease.
If the broker cannot be reached at the refresh point (a transport error, a
5xx or a 429), the cached token is handed out until it expires, a minute at a
time, with a warning on standard error. After the broker's 401 or 403 it is
not, and the cache entry is deleted.

When the API server refuses a cached token (its lease was revoked), client-go
runs the plugin again in the same process; the plugin sees that the same
process asks before the refresh point, drops the token and asks the broker
for a new one. The kubectl command that met the refusal fails once; the next
one works.

--no-cache asks the broker at every invocation (a CI job that runs one
command). --credential client-certificate caches a client certificate and key
instead; its refusal after a revocation is a 403, on which client-go does not
run the plugin again, so it is used until its refresh point.

--access gateway asks for a lease of the broker's lease gateway: a client
certificate for that one lease (the key is made here and never sent), good
only at the gateway, which then forwards each request as the ServiceAccount.
The answer carries the certificate and key; the kubeconfig that runs the
plugin must point at the gateway ("get kubeconfig --exec --access gateway"
and the broker's exec kubeconfigs do). The gateway answers a revoked lease's
requests with 401, so it is replaced as a refused token is (above). Without
--access the broker uses the mode of the grant that allows the request.

On failure the plugin writes one line to standard error, "tokenbroker
credential: ...", which kubectl shows, and exits with status 1. It never
writes a token to standard error.

As a ClusterProfile access provider (docs/guides/clusterprofile.md), the
plugin runs with provideClusterInfo: KUBERNETES_EXEC_INFO carries
spec.cluster, and its config (the ClusterProfile entry's
client.authentication.k8s.io/exec extension, a tokenbroker.io/v1
PluginTarget) names the broker, namespace, ServiceAccount, ttl,
audiences and access; only --identity-dir and the cache flags are then given. Whenever
spec.cluster is given, the plugin hands out a credential only if its server
and CA are the ones the broker's kubeconfigs name (it asks the broker with
POST /v1/kubeconfigs?format=exec, which issues nothing, before it issues):
whoever can write a ClusterProfile chooses where client-go sends the token.

Every flag can also be set as TOKENBROKER_<FLAG> (upper case, dashes as
underscores), e.g. TOKENBROKER_CACHE_DIR.`,
		Example: `  # what kubectl runs for a kubeconfig from "tokenbroker get kubeconfig --exec"
  tokenbroker credential --broker https://east.example.com:8443 \
    --identity-dir /home/me/west-identity --namespace argo --service-account runner --ttl 8h

  # a kubeconfig that runs it
  tokenbroker get kubeconfig --exec --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --service-account runner --ttl 8h -o east.kubeconfig
  kubectl --kubeconfig east.kubeconfig get pods

  # in CI: no cache, a new lease per job
  TOKENBROKER_NO_CACHE=true kubectl --kubeconfig east.kubeconfig apply -f manifests/`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			err := runE(newFlagViper, credentialConfigFrom, runCredential)(cmd, args)
			if err != nil {
				return &commandError{command: "credential", err: err}
			}
			return nil
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return &commandError{command: "credential", err: err}
	})
	fs := cmd.Flags()
	addBrokerRequestFlags(fs)
	fs.Bool("no-cache", false, "ask the broker at every invocation, and read or write no cache")
	fs.String("cache-dir", "", "directory of the credential cache (default $XDG_CACHE_HOME/tokenbroker, else ~/.cache/tokenbroker)")
	fs.Float64("refresh-fraction", execcred.DefaultRefreshFraction, "part of a token's granted life after which a new one is issued, between 0 and 1")
	fs.String("workload-token-file", "", "a ServiceAccount token of this cluster (a projected token with the broker's audience) that says which workload asks; cached credentials are kept per workload")
	return cmd
}

func credentialConfigFrom(v *viper.Viper) (credentialConfig, error) {
	return credentialConfigFromEnv(v, os.LookupEnv)
}

// targetFlags are the flags a ClusterProfile's exec extension (an
// apiv1.PluginTarget in spec.cluster.config) takes the place of.
var targetFlags = []string{"broker", "namespace", "service-account", "credential", "ttl", "min-ttl", "audience", "access"}

// credentialConfigFromEnv is credentialConfigFrom with the environment
// read by lookup. When KUBERNETES_EXEC_INFO carries a PluginTarget (the
// plugin runs as a ClusterProfile access provider), the target comes from
// it and only the identity and cache from flags or TOKENBROKER_*: a target
// flag given as well is an error, since two targets cannot both be meant.
func credentialConfigFromEnv(v *viper.Viper, lookup func(string) (string, bool)) (credentialConfig, error) {
	info, err := execcred.ExecInfoFromEnv(lookup)
	if err != nil {
		return credentialConfig{}, err
	}
	if info.Cluster != nil && info.Cluster.Target != nil {
		var set []string
		for _, f := range targetFlags {
			if v.IsSet(f) {
				set = append(set, "--"+f)
			}
		}
		if len(set) > 0 {
			return credentialConfig{}, fmt.Errorf("%s: the target is the ClusterProfile's (spec.cluster.config); give only --identity-dir and the cache flags", strings.Join(set, ", "))
		}
		tgt := info.Cluster.Target
		v.Set("broker", tgt.Broker)
		v.Set("namespace", tgt.Namespace)
		v.Set("service-account", tgt.ServiceAccount)
		v.Set("ttl", tgt.TTL)
		v.Set("min-ttl", tgt.MinTTL)
		v.Set("audience", tgt.Audiences)
		if tgt.Credential != "" {
			v.Set("credential", tgt.Credential)
		}
		v.Set("access", tgt.Access)
	}
	r, errs := brokerRequestFrom(v)
	cfg := credentialConfig{
		brokerRequest:     r,
		Info:              info,
		NoCache:           v.GetBool("no-cache"),
		CacheDir:          v.GetString("cache-dir"),
		RefreshFraction:   v.GetFloat64("refresh-fraction"),
		WorkloadTokenFile: v.GetString("workload-token-file"),
	}
	if !(cfg.RefreshFraction > 0 && cfg.RefreshFraction < 1) {
		errs = append(errs, fmt.Errorf("--refresh-fraction must be between 0 and 1, not %v", cfg.RefreshFraction))
	}
	if !cfg.NoCache {
		dir, err := credentialCacheDir(cfg.CacheDir)
		errs = append(errs, err)
		cfg.CacheDir = dir
	}
	return cfg, errors.Join(errs...)
}

// credentialCacheDir is --cache-dir made absolute, or
// $XDG_CACHE_HOME/tokenbroker (os.UserCacheDir: ~/.cache without it).
func credentialCacheDir(flag string) (string, error) {
	if flag != "" {
		dir, err := filepath.Abs(flag)
		if err != nil {
			return "", fmt.Errorf("--cache-dir: %w", err)
		}
		return dir, nil
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("no cache directory (%w): give --cache-dir, or --no-cache", err)
	}
	return filepath.Join(base, "tokenbroker"), nil
}

func runCredential(cmd *cobra.Command, cfg credentialConfig) error {
	info := cfg.Info
	identity, err := execcred.PeerIdentity(agent.IdentityDir(cfg.IdentityDir).Cert())
	if err != nil {
		return err
	}
	clk := clock.RealClock{}
	plugin := &execcred.Plugin{
		Clock:           clk,
		RefreshFraction: cfg.RefreshFraction,
		Warn: func(err error) {
			fmt.Fprintln(cmd.ErrOrStderr(), "tokenbroker credential: warning:", oneLine(err.Error()))
		},
	}
	if !cfg.NoCache {
		if plugin.Cache, err = execcred.OpenCache(cfg.CacheDir); err != nil {
			return err
		}
	}
	// The token-theft guard: client-go named the cluster the credential
	// goes to (provideClusterInfo, always so for a ClusterProfile), so
	// hand it out only for the broker's own cluster.
	var guard *execcred.Cluster
	if info.Cluster != nil {
		guard = info.Cluster
		plugin.Guard = func(c *execcred.Credential) error { return execcred.CheckCluster(*guard, *c.Cluster) }
	}
	var parent execcred.Parent
	if info.FromClientGo {
		parent = execcred.ParentOf("/proc", os.Getppid())
	}
	key := execcred.Key{
		Broker:         cfg.Broker,
		Identity:       identity,
		Namespace:      cfg.Request.Namespace,
		ServiceAccount: cfg.Request.ServiceAccount,
		Credential:     cfg.Request.Credential,
		Audiences:      cfg.Request.Audiences,
		TTL:            cfg.Request.TTL,
		MinTTL:         cfg.Request.MinTTL,
		Access:         cfg.Request.Access,
	}
	if cfg.WorkloadTokenFile != "" {
		// The cache is keyed by the workload the token names now: a token
		// file that another workload's token replaced never gets the
		// first one's cached credential.
		token, err := client.WorkloadTokenFile(cfg.WorkloadTokenFile)()
		if err != nil {
			return err
		}
		if key.Workload, err = execcred.WorkloadOf(token); err != nil {
			return err
		}
	}
	cred, _, err := plugin.Get(cmd.Context(), key, parent, func(ctx context.Context) (*execcred.Credential, error) {
		return issueCredential(ctx, cfg, clk, guard)
	})
	if err != nil {
		return err
	}
	out, err := execcred.Encode(info.APIVersion, cred.Status())
	if err != nil {
		return err
	}
	if _, err := cmd.OutOrStdout().Write(out); err != nil {
		return fmt.Errorf("write the ExecCredential: %w", err)
	}
	return nil
}

// issueCredential asks the broker once, on the code path of "get
// kubeconfig" and the agent. With a guard (the cluster client-go will send
// the credential to), it first asks the broker which cluster its
// kubeconfigs name (POST /v1/kubeconfigs?format=exec, which issues
// nothing) and issues only if that is the guard's; an issued credential
// whose kubeconfig names another cluster after all is revoked.
func issueCredential(ctx context.Context, cfg credentialConfig, clk clock.PassiveClock, guard *execcred.Cluster) (*execcred.Credential, error) {
	c, err := agent.NewWorkloadClient(ctx, cfg.Broker, agent.IdentityDir(cfg.IdentityDir), cfg.WorkloadTokenFile)
	if err != nil {
		return nil, err
	}
	defer c.CloseIdleConnections()
	if guard != nil {
		kc, err := c.ExecKubeconfig(ctx, cfg.Request.APIRequest())
		if err != nil {
			return nil, fmt.Errorf("broker %s: %w", cfg.Broker, err)
		}
		want, err := execcred.ClusterOfKubeconfig(kc)
		if err != nil {
			return nil, fmt.Errorf("broker %s: %w", cfg.Broker, err)
		}
		if err := execcred.CheckCluster(*guard, want); err != nil {
			return nil, err
		}
	}
	cred, err := agent.Fetch(ctx, c, cfg.Request, clk.Now)
	if err != nil {
		return nil, fmt.Errorf("broker %s: %w", cfg.Broker, err)
	}
	cluster := &execcred.ClusterRef{Server: cred.Server, CAData: cred.CAData}
	if guard != nil {
		if err := execcred.CheckCluster(*guard, *cluster); err != nil {
			_ = c.RevokeLease(ctx, cred.LeaseID) // best effort: it would expire unused anyway
			return nil, err
		}
	}
	return &execcred.Credential{
		Cluster:               cluster,
		LeaseID:               cred.LeaseID,
		Token:                 cred.Token,
		ClientCertificateData: string(cred.CertData),
		ClientKeyData:         string(cred.KeyData),
		ObtainedAt:            cred.ObtainedAt,
		ExpiresAt:             cred.ExpiresAt,
	}, nil
}

// commandError is the failure of a command whose standard error a person
// reads through another program (kubectl shows an exec plugin's): main
// prints it as one line, "tokenbroker <command>: <error>".
type commandError struct {
	command string
	err     error
}

func (e *commandError) Error() string { return e.command + ": " + e.err.Error() }
func (e *commandError) Unwrap() error { return e.err }

// errorLine is what main prints for a failed command.
func errorLine(err error) string {
	var ce *commandError
	if errors.As(err, &ce) {
		return "tokenbroker " + ce.command + ": " + oneLine(ce.err.Error())
	}
	return "tokenbroker: " + err.Error()
}

// oneLine joins the lines of a message (errors.Join puts each error on its
// own line) with "; ".
func oneLine(s string) string {
	var parts []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			parts = append(parts, l)
		}
	}
	return strings.Join(parts, "; ")
}
