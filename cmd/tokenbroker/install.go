package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/tokenbroker/tokenbroker/pki"
)

func newInstallCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "install DIR",
		Short: "Copy this binary into DIR, for an init container that gives another pod the exec plugin",
		Long: `Copy this tokenbroker binary into DIR/tokenbroker (mode 0755, replaced
atomically). Our image has no shell and no cp, so an init container that
shares an emptyDir with Argo CD's, Kueue's or another controller's container
runs this to give it "tokenbroker credential" (docs/guides/argocd.md). The
directory must exist.`,
		Example: `  tokenbroker install /tokenbroker

  # as an init container in the application controller's pod
  initContainers:
    - name: tokenbroker
      image: ghcr.io/tokenbroker/tokenbroker:0.1.0
      args: [install, /tokenbroker]
      volumeMounts: [{name: tokenbroker, mountPath: /tokenbroker}]`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			self, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find this binary: %w", err)
			}
			data, err := os.ReadFile(self)
			if err != nil {
				return fmt.Errorf("read this binary: %w", err)
			}
			dst := filepath.Join(args[0], "tokenbroker")
			if err := pki.WriteFileAtomic(dst, data, 0o755); err != nil {
				return fmt.Errorf("install: %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "installed %s (tokenbroker %s)\n", dst, currentBuild().Version)
			return nil
		},
	}
}
