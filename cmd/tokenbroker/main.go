// Command tokenbroker is the single tokenbroker binary: the broker (serve),
// the agent that keeps kubeconfigs fresh in source clusters (agent), its
// one-shot form (get kubeconfig), the kubectl exec credential plugin
// (credential), enrollment and renewal of a cluster's
// client certificate (enroll, renew), the PKI tool (pki), a local
// development setup (dev) and its version.
//
// main only builds the signal context and the command tree; each command
// turns its flags, TOKENBROKER_* environment variables and config file into
// a typed configuration and hands it to a run function.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	// Mozilla's root certificates, used only where the system has none, as
	// in the container image (no /etc/ssl): the binary can then verify
	// public HTTPS endpoints such as an OIDC issuer's JWKS. Peers, brokers
	// and API servers are always verified against the CAs the
	// configuration names, never against these.
	_ "golang.org/x/crypto/x509roots/fallback"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, errorLine(err))
		os.Exit(1)
	}
}
