package main

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/tokenbroker/tokenbroker/server"
)

// buildInfo is what "tokenbroker version" reports: the release version set
// with -ldflags, and what the Go toolchain recorded about the build.
type buildInfo struct {
	// Version is main.version (make build sets it from git describe), else
	// the module version when built with "go install ...@vX", else "dev".
	Version string `json:"version"`
	// Revision is the VCS commit the binary was built from; empty when the
	// build had no VCS information (go build -buildvcs=false, go run).
	Revision string `json:"revision,omitempty"`
	// CommitTime is the commit's time; nil when unknown.
	CommitTime *time.Time `json:"commitTime,omitempty"`
	// Dirty is true when the work tree had uncommitted changes.
	Dirty     bool   `json:"dirty"`
	GoVersion string `json:"goVersion"`
	Platform  string `json:"platform"`
}

// currentBuild describes this binary.
func currentBuild() buildInfo {
	bi, ok := debug.ReadBuildInfo()
	return buildInfoFrom(version, bi, ok)
}

// buildInfoFrom combines the ldflags version with the build information
// the Go toolchain embeds (the vcs.* settings).
func buildInfoFrom(ldflagsVersion string, bi *debug.BuildInfo, ok bool) buildInfo {
	b := buildInfo{
		Version:   ldflagsVersion,
		GoVersion: runtime.Version(),
		Platform:  runtime.GOOS + "/" + runtime.GOARCH,
	}
	if !ok || bi == nil {
		return b
	}
	if bi.GoVersion != "" {
		b.GoVersion = bi.GoVersion
	}
	if b.Version == "dev" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		b.Version = bi.Main.Version
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			if t, err := time.Parse(time.RFC3339, s.Value); err == nil {
				b.CommitTime = &t
			}
		case "vcs.modified":
			b.Dirty = s.Value == "true"
		}
	}
	return b
}

// server is the build as the broker reports it.
func (b buildInfo) server() server.Build {
	return server.Build{Version: b.Version, Revision: b.revisionLabel(), GoVersion: b.GoVersion}
}

// revisionLabel is the revision for tokenbroker_build_info: the commit,
// with "-dirty" for uncommitted changes, or "unknown".
func (b buildInfo) revisionLabel() string {
	switch {
	case b.Revision == "":
		return "unknown"
	case b.Dirty:
		return b.Revision + "-dirty"
	}
	return b.Revision
}

func newVersionCommand() *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "version [-o json]",
		Short: "Print the version, the commit it was built from, and the Go version",
		Long: `Print the version of this binary (set at build time by "make build" from git
describe), the git commit it was built from with its time and whether the
work tree had uncommitted changes (from the build information the Go
toolchain embeds), the Go version and the platform.

The first line is always "tokenbroker <version>".`,
		Example: `  tokenbroker version
  tokenbroker version -o json | jq -r .revision`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return printVersion(cmd.OutOrStdout(), currentBuild(), output)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	_ = cmd.RegisterFlagCompletionFunc("output", cobra.FixedCompletions([]string{"text", "json"}, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

func printVersion(w io.Writer, b buildInfo, output string) error {
	switch output {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(b)
	case "text", "":
	default:
		return fmt.Errorf("--output must be text or json, not %q", output)
	}
	rev, when := "unknown (built without VCS information)", "unknown"
	if b.Revision != "" {
		rev = b.Revision
		if b.Dirty {
			rev += " (dirty: uncommitted changes)"
		}
	}
	if b.CommitTime != nil {
		when = b.CommitTime.UTC().Format(time.RFC3339)
	}
	_, err := fmt.Fprintf(w, "tokenbroker %s\n  revision:    %s\n  commit time: %s\n  go:          %s\n  platform:    %s\n",
		b.Version, rev, when, b.GoVersion, b.Platform)
	return err
}
