package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestInstallCopiesThisBinaryExecutable(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	root := newRootCommand()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"install", dir})
	require.NoError(t, root.Execute())
	require.Contains(t, out.String(), filepath.Join(dir, "tokenbroker"))

	self, err := os.Executable()
	require.NoError(t, err)
	want, err := os.ReadFile(self)
	require.NoError(t, err)
	got, err := os.ReadFile(filepath.Join(dir, "tokenbroker"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(want, got), "a byte-for-byte copy")
	st, err := os.Stat(filepath.Join(dir, "tokenbroker"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), st.Mode().Perm())

	root = newRootCommand()
	root.SetOut(new(bytes.Buffer))
	root.SetErr(new(bytes.Buffer))
	root.SetArgs([]string{"install", filepath.Join(dir, "missing")})
	require.Error(t, root.Execute(), "the directory must exist")
}
