// Command tokenbroker is the single tokenbroker binary: the broker (serve),
// the agent that keeps kubeconfigs fresh in source clusters (agent), its
// one-shot form (get kubeconfig), enrollment and renewal of a cluster's
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
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "tokenbroker:", err)
		os.Exit(1)
	}
}
