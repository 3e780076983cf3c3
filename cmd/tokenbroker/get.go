package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/viper"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/execcred"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func newGetCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "get",
		Short: "Get something from a broker once (for scripts and debugging)",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newGetKubeconfigCommand())
	return cmd
}

// getKubeconfigConfig is the typed configuration of "tokenbroker get
// kubeconfig".
type getKubeconfigConfig struct {
	brokerRequest
	Output string
	Format string
	// Exec asks for a kubeconfig whose user runs "tokenbroker credential"
	// (ExecCommand, else this binary) instead of holding a token.
	Exec        bool
	ExecCommand string
	// WorkloadTokenFile is sent as the workload token ("" for none).
	WorkloadTokenFile string
}

const (
	getFormatKubeconfig = "kubeconfig"
	getFormatJSON       = "json"
)

func newGetKubeconfigCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "kubeconfig --broker URL --identity-dir DIR --namespace NS (--service-account SA | --credential client-certificate)",
		Short: "Get a kubeconfig for a ServiceAccount (or a client certificate) of the broker's cluster, once",
		Long: `Ask a broker for a kubeconfig once, as the agent does on every refresh (the same
request, the same checks of the answer, the same atomic file write), and write
it to standard output or to a file.

The client certificate, its key and the trust bundle come from --identity-dir
(tls.crt, tls.key, ca.crt, as "tokenbroker enroll" writes them). --ttl is the
lifetime asked for (empty: the broker's policy default); with --min-ttl the
broker refuses (422) rather than grant less. The lease id and expiry go to
standard error; the credential only to the output.

With --credential client-certificate the kubeconfig carries a client
certificate instead of a token, for a per-lease user whose permissions are the
role the broker's policy grants in --namespace (no --service-account). The key
is made here and never sent: the broker signs a CSR for it.

With --access gateway the kubeconfig points at the broker's lease gateway and
carries a client certificate for that one lease (with --service-account, no
--audience), good nowhere else; the gateway forwards each request as the
ServiceAccount and ends the lease's open connections when it is revoked. The
key is made here and never sent. Without --access the broker uses the mode of
the grant that allows the request.

With -o FILE the file is replaced atomically with mode 0600, and only if its
content changed. --format json writes the broker's whole answer (leaseId,
kubeconfig, token, expiresAt, grantedTTL...). Nothing revokes the lease: it
expires by itself, or use DELETE /v1/leases/{id}.

With --exec the kubeconfig holds no credential: its user runs "tokenbroker
credential" with the same broker, identity directory (made absolute) and
request, which kubectl runs to get a token that renews itself (see "tokenbroker
credential --help" and docs/guides/kubectl.md). The cluster entry is the
broker's: one request is made as without --exec, to learn it and to check
that the policy grants the request, and that lease is revoked at once. The
command is the absolute path of this binary, or --exec-command (e.g.
"tokenbroker", for a kubeconfig used where the binary is elsewhere on PATH).

Every flag can also be set as TOKENBROKER_<FLAG> (upper case, dashes as
underscores), e.g. TOKENBROKER_IDENTITY_DIR.`,
		Example: `  # a kubeconfig for argo/admiralty-source, valid for 2 hours, to a file
  tokenbroker get kubeconfig --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --service-account admiralty-source \
    --ttl 2h -o east.kubeconfig
  kubectl --kubeconfig east.kubeconfig get pods

  # the whole answer as JSON, to read the lease id with jq
  tokenbroker get kubeconfig --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --service-account admiralty-source \
    --format json | jq -r .leaseId

  # a kubeconfig that stays valid: kubectl runs "tokenbroker credential" for a token
  tokenbroker get kubeconfig --exec --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --service-account runner --ttl 8h -o east.kubeconfig

  # a client certificate whose key never leaves this machine
  tokenbroker get kubeconfig --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --credential client-certificate -o east-cert.kubeconfig

  # through the broker's lease gateway: revoking the lease ends its open watches
  tokenbroker get kubeconfig --broker https://east.example.com:8443 \
    --identity-dir west-identity --namespace argo --service-account runner --access gateway -o east-gw.kubeconfig`,
		Args: cobra.NoArgs,
		RunE: runE(newFlagViper, getKubeconfigConfigFrom, runGetKubeconfig),
	}
	fs := cmd.Flags()
	addBrokerRequestFlags(fs)
	fs.StringP("output", "o", "-", `file to write, "-" for standard output`)
	fs.String("format", getFormatKubeconfig, "what to write: kubeconfig or json (the broker's whole answer)")
	fs.Bool("exec", false, `write a kubeconfig whose user runs "tokenbroker credential" instead of holding a token`)
	fs.String("exec-command", "", "with --exec, the command the kubeconfig runs (default: the absolute path of this binary)")
	fs.String("workload-token-file", "", "a ServiceAccount token of this cluster (a projected token with the broker's audience) that says which workload asks; the broker then grants what its policy grants that workload")
	return cmd
}

func getKubeconfigConfigFrom(v *viper.Viper) (getKubeconfigConfig, error) {
	r, errs := brokerRequestFrom(v)
	cfg := getKubeconfigConfig{
		brokerRequest:     r,
		Output:            v.GetString("output"),
		Format:            v.GetString("format"),
		Exec:              v.GetBool("exec"),
		ExecCommand:       v.GetString("exec-command"),
		WorkloadTokenFile: v.GetString("workload-token-file"),
	}
	if cfg.Format != getFormatKubeconfig && cfg.Format != getFormatJSON {
		errs = append(errs, fmt.Errorf("--format must be %s or %s, not %q", getFormatKubeconfig, getFormatJSON, cfg.Format))
	}
	if cfg.Output == "" {
		errs = append(errs, errors.New(`--output must name a file or be "-"`))
	}
	if cfg.Exec && cfg.Format != getFormatKubeconfig {
		errs = append(errs, errors.New("--exec writes a kubeconfig: --format must be kubeconfig"))
	}
	if cfg.ExecCommand != "" && !cfg.Exec {
		errs = append(errs, errors.New("--exec-command is for --exec"))
	}
	return cfg, errors.Join(errs...)
}

func runGetKubeconfig(cmd *cobra.Command, cfg getKubeconfigConfig) error {
	c, err := agent.NewWorkloadClient(cmd.Context(), cfg.Broker, agent.IdentityDir(cfg.IdentityDir), cfg.WorkloadTokenFile)
	if err != nil {
		return err
	}
	defer c.CloseIdleConnections()
	cred, err := agent.Fetch(cmd.Context(), c, cfg.Request, time.Now)
	if err != nil {
		return err
	}
	data := cred.Kubeconfig
	if cfg.Exec {
		if data, err = execKubeconfig(cmd.Context(), c, cred, cfg); err != nil {
			return err
		}
	} else if cfg.Format == getFormatJSON {
		if data, err = json.MarshalIndent(cred.Response(), "", "  "); err != nil {
			return fmt.Errorf("encode answer: %w", err)
		}
		data = append(data, '\n')
	}
	if cfg.Output == "-" {
		if _, err := cmd.OutOrStdout().Write(data); err != nil {
			return fmt.Errorf("write kubeconfig: %w", err)
		}
	} else if _, err := agent.WriteKubeconfigFile(cfg.Output, data); err != nil {
		return err
	}
	if cfg.Exec {
		printExec(cmd.ErrOrStderr(), cred, cfg)
	} else {
		printLease(cmd.ErrOrStderr(), cred, cfg)
	}
	return nil
}

// execKubeconfig revokes the lease that was asked for only to learn the
// cluster entry, and returns the kubeconfig whose user runs the plugin.
// Nothing is written when the lease cannot be revoked: a token nobody holds
// must not stay valid.
func execKubeconfig(ctx context.Context, c *client.Client, cred *agent.Credential, cfg getKubeconfigConfig) ([]byte, error) {
	if err := c.RevokeLease(ctx, cred.LeaseID); err != nil {
		return nil, fmt.Errorf("revoke lease %s, asked for only to learn the cluster (revoke it with DELETE /v1/leases/%s): %w", cred.LeaseID, cred.LeaseID, err)
	}
	command := cfg.ExecCommand
	if command == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("the path of this binary, for the kubeconfig's command (give --exec-command): %w", err)
		}
		command = exe
	}
	dir, err := filepath.Abs(cfg.IdentityDir)
	if err != nil {
		return nil, fmt.Errorf("--identity-dir: %w", err)
	}
	tokenFile := cfg.WorkloadTokenFile
	if tokenFile != "" {
		if tokenFile, err = filepath.Abs(tokenFile); err != nil {
			return nil, fmt.Errorf("--workload-token-file: %w", err)
		}
	}
	return execcred.KubeconfigFromBroker(cred.Kubeconfig, command, execcred.Target{
		Broker:      cfg.Broker,
		IdentityDir: dir,
		RequestSpec: apiv1.RequestSpec(cfg.Request),
		// The plugin reads the token at every run: the kubelet rotates it.
		WorkloadTokenFile: tokenFile,
	})
}

// printExec tells the user what the exec kubeconfig is for.
func printExec(w io.Writer, c *agent.Credential, cfg getKubeconfigConfig) {
	msg := fmt.Sprintf("exec kubeconfig for %s (the lease %s that showed the cluster is revoked)", cfg.Request.Subject(), c.LeaseID)
	if cfg.Output != "-" {
		msg += "; written to " + cfg.Output
	}
	_, _ = fmt.Fprintln(w, msg)
}

// printLease tells the user what was granted, never the credential.
func printLease(w io.Writer, c *agent.Credential, cfg getKubeconfigConfig) {
	msg := fmt.Sprintf("lease %s for %s expires at %s (granted %s",
		c.LeaseID, cfg.Request.Subject(), c.ExpiresAt.UTC().Format(time.RFC3339), c.GrantedTTL)
	if c.ClampedBy != "" {
		msg += ", clamped by " + c.ClampedBy
	}
	msg += ")"
	if cfg.Output != "-" {
		msg += "; written to " + cfg.Output
	}
	_, _ = fmt.Fprintln(w, msg)
}
