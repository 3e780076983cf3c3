package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// walkCommands calls fn for cmd and every command below it.
func walkCommands(cmd *cobra.Command, fn func(*cobra.Command)) {
	fn(cmd)
	for _, c := range cmd.Commands() {
		walkCommands(c, fn)
	}
}

// cobraGenerated are the commands cobra adds itself; "completion" has
// its own instructions per shell.
func cobraGenerated(c *cobra.Command) bool {
	for p := c; p != nil; p = p.Parent() {
		if p.Name() == "help" || p.Name() == "completion" || p.Name() == cobra.ShellCompRequestCmd || p.Name() == cobra.ShellCompNoDescRequestCmd {
			return true
		}
	}
	return false
}

func TestEveryCommandHasAnExampleThatUsesIt(t *testing.T) {
	t.Parallel()
	root := newRootCommand()
	// The commands cobra adds at Execute, so that the walk sees the tree
	// as users do.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	n := 0
	walkCommands(root, func(c *cobra.Command) {
		if !c.Runnable() || cobraGenerated(c) {
			return
		}
		n++
		require.NotEmpty(t, c.Example, "%q has no Example", c.CommandPath())
		require.Contains(t, c.Example, c.CommandPath(), "the Example of %q shows it", c.CommandPath())
		require.NotEmpty(t, c.Short, "%q has no Short", c.CommandPath())
	})
	require.GreaterOrEqual(t, n, 17, "the walk reached every command")
}

func TestEveryNewAdminCommandIsInTheTree(t *testing.T) {
	t.Parallel()
	root := newRootCommand()
	for _, path := range [][]string{{"leases"}, {"leases", "revoke"}, {"config", "validate"}, {"version"}} {
		c, rest, err := root.Find(path)
		require.NoError(t, err, path)
		require.Empty(t, rest, path)
		require.Equal(t, path[len(path)-1], c.Name())
	}
}

// complete asks the command tree for completions as a shell would.
func complete(t *testing.T, args ...string) []string {
	t.Helper()
	root := newRootCommand()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(new(bytes.Buffer))
	root.SetArgs(append([]string{cobra.ShellCompNoDescRequestCmd}, args...))
	require.NoError(t, root.Execute())
	var values []string
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if !strings.HasPrefix(l, ":") {
			values = append(values, l)
		}
	}
	return values
}

func TestOutputFormatsAndKindsComplete(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"table", "wide", "json"}, complete(t, "leases", "-o", ""))
	require.Equal(t, []string{"text", "json"}, complete(t, "version", "-o", ""))
	require.Equal(t, []string{"auto", "policy", "agent", "serve"}, complete(t, "config", "validate", "--kind", ""))
	require.Equal(t, []string{"yaml", "yml", "json"}, complete(t, "config", "validate", ""))
}
