package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/pki"
)

func newEnrollCommand() *cobra.Command {
	var brokerURL, fingerprint, tokenFile, dir string
	var clusterCA bool
	cmd := &cobra.Command{
		Use:   "enroll --broker URL --ca-fingerprint sha256:HEX --token-file FILE --dir DIR [--cluster-ca]",
		Short: "Join a broker with a join token: get a client certificate for this cluster",
		Long: `Enroll this cluster with a broker, using a single-use join token made on the
CA side with "tokenbroker pki join-token".

The trust bundle is fetched from the broker's enrollment listener and accepted
only if it holds the CA with the pinned --ca-fingerprint (printed by
"pki join-token") and the broker's certificate chains to that CA alone: the
other certificates of the bundle, which whoever answers chooses, may only be
intermediates below it. The token is sent only then. A new key pair is made
here and never leaves this machine; the broker signs a certificate for the
identity named in the token, and its answer must hold the pinned CA too.

Writes DIR/tls.crt, DIR/tls.key (mode 0600) and DIR/ca.crt: the pinned CA and
the bundle's CAs below it, never another CA the broker sent. With --cluster-ca
it also asks for the cluster's CA (the broker must run with --sign-cluster-cas)
and writes DIR/cluster-ca.crt and DIR/cluster-ca.key (0600), for the agent's
pod-certificate signer; "tokenbroker renew" keeps renewing it. The token is read
from --token-file ("-" for standard input) or $TOKENBROKER_JOIN_TOKEN, never
from a flag, so that it does not end up in shell history or ps output.`,
		Example: `  # on the CA side
  tokenbroker pki join-token --ca-dir ca --trust-domain oc.example --cluster west --audience east > west.token
  # on the new cluster
  tokenbroker enroll --broker https://east.example.com:8444 \
    --ca-fingerprint sha256:3f1c... --token-file west.token --dir west-identity`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			token, err := readJoinToken(tokenFile, cmd.InOrStdin())
			if err != nil {
				return err
			}
			start := time.Now()
			resp, err := agent.Enroll(cmd.Context(), agent.EnrollOptions{
				BrokerURL: brokerURL, Fingerprint: fingerprint, Token: token, Dir: agent.IdentityDir(dir), ClusterCA: clusterCA,
			})
			if err != nil {
				return err
			}
			d := agent.IdentityDir(dir)
			fmt.Fprintf(cmd.OutOrStdout(), "enrolled as %s in %s\n  certificate %s (serial %s, expires %s)\n  key         %s\n  trust       %s\n",
				resp.Identity, time.Since(start).Round(time.Millisecond), d.Cert(), resp.SerialNumber,
				resp.NotAfter.Format(time.RFC3339), d.Key(), d.Bundle())
			if clusterCA {
				fmt.Fprintf(cmd.OutOrStdout(), "  cluster CA  %s, key %s\n", d.ClusterCACert(), d.ClusterCAKey())
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&brokerURL, "broker", "", "URL of the broker's enrollment listener, e.g. https://east.example.com:8444 (required)")
	fs.StringVar(&fingerprint, "ca-fingerprint", "", "SHA-256 fingerprint of the CA to trust, sha256:HEX (required)")
	fs.StringVar(&tokenFile, "token-file", "", `file holding the join token, "-" for stdin (default $TOKENBROKER_JOIN_TOKEN)`)
	fs.StringVar(&dir, "dir", "", "directory for tls.crt, tls.key and ca.crt (required)")
	fs.BoolVar(&clusterCA, "cluster-ca", false, "also get the cluster's CA (cluster-ca.crt, cluster-ca.key), for the agent's pod signer; the broker must run with --sign-cluster-cas")
	for _, f := range []string{"broker", "ca-fingerprint", "dir"} {
		_ = cmd.MarkFlagRequired(f)
	}
	return cmd
}

func readJoinToken(file string, stdin io.Reader) (string, error) {
	if file == "" {
		token := strings.TrimSpace(os.Getenv("TOKENBROKER_JOIN_TOKEN"))
		if token == "" {
			return "", errors.New("give the join token with --token-file or $TOKENBROKER_JOIN_TOKEN")
		}
		if len(token) > pki.MaxJoinTokenBytes {
			return "", fmt.Errorf("the join token is over %d bytes", pki.MaxJoinTokenBytes)
		}
		return token, nil
	}
	return pki.ReadJoinToken(file, stdin)
}

func newRenewCommand() *cobra.Command {
	var brokerURL, dir string
	cmd := &cobra.Command{
		Use:   "renew --broker URL --dir DIR",
		Short: "Renew this cluster's client certificate with the broker",
		Long: `Renew the client certificate in DIR (tls.crt, tls.key, ca.crt, as written by
"tokenbroker enroll") while it is still valid: a new key pair is made here, the
broker signs a certificate for the same identity, and the files are replaced
atomically. A directory with a cluster CA (cluster-ca.crt, cluster-ca.key)
gets a new one with a new key too. The old files stay if renewal fails. The
agent does this by itself; this command is for scripts and debugging.`,
		Example: `  tokenbroker renew --broker https://east.example.com:8443 --dir west-identity`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d := agent.IdentityDir(dir)
			c, err := agent.NewIdentityClient(cmd.Context(), brokerURL, d)
			if err != nil {
				return err
			}
			resp, err := agent.Renew(cmd.Context(), c, d)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "renewed %s: serial %s, expires %s\n", resp.Identity, resp.SerialNumber, resp.NotAfter.Format(time.RFC3339))
			return nil
		},
	}
	cmd.Flags().StringVar(&brokerURL, "broker", "", "URL of the broker's mTLS listener (required)")
	cmd.Flags().StringVar(&dir, "dir", "", "identity directory with tls.crt, tls.key and ca.crt (required)")
	_ = cmd.MarkFlagRequired("broker")
	_ = cmd.MarkFlagRequired("dir")
	return cmd
}
