package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/agent/config"
	"k8s.io/client-go/tools/clientcmd"
)

// A token file output keeps the token beside a kubeconfig that names it:
// a refresh rewrites only the token file, client-go's own loader resolves
// the relative name against the kubeconfig's directory, and a restart
// recovers the whole credential from the two files.
func TestATokenFileOutputRewritesOnlyTheTokenOnARefresh(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "kubeconfig")
	o := &fileOutput{cfg: config.FileOutput{Path: path, TokenFile: "token"}}
	ctx := context.Background()
	c := goldenCredential(t)

	wrote, err := o.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.True(t, wrote)
	for _, p := range []string{path, path + config.MetaSuffix, filepath.Join(dir, "token")} {
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), p)
	}
	kc, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NotContains(t, string(kc), c.Token, "the kubeconfig holds no token")

	// client-go's loader, run from another directory (the package's).
	rc, err := clientcmd.BuildConfigFromFlags("", path)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "token"), rc.BearerTokenFile)
	require.Equal(t, c.Token, rc.BearerToken, "clientcmd read the file")
	require.Equal(t, "https://east.example.com:6443", rc.Host)

	before, err := os.Stat(path)
	require.NoError(t, err)
	next := nextCredential(c)
	wrote, err = o.write(ctx, goldenMeta, next)
	require.NoError(t, err)
	require.True(t, wrote)
	tok, err := os.ReadFile(filepath.Join(dir, "token"))
	require.NoError(t, err)
	require.Equal(t, next.Token, string(tok))
	after, err := os.Stat(path)
	require.NoError(t, err)
	require.True(t, os.SameFile(before, after) && before.ModTime().Equal(after.ModTime()), "the kubeconfig is not rewritten for a new token")

	st, err := o.read(ctx)
	require.NoError(t, err)
	require.Equal(t, next.LeaseID, st.leaseID)
	require.False(t, st.outdated)
	parts, err := parseKubeconfig(st.kubeconfig)
	require.NoError(t, err)
	require.Equal(t, next.Token, parts.token, "recovery gets the token back into the kubeconfig")

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 3, "no temporary file is left behind")
}

// A file output that switches to or from a token file holds its lease
// under old settings: it is written again rather than adopted as it is.
func TestAFileOutputThatGainsATokenFileIsRewritten(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	ctx := context.Background()
	_, err := (&fileOutput{cfg: config.FileOutput{Path: path}}).write(ctx, goldenMeta, goldenCredential(t))
	require.NoError(t, err)

	st, err := (&fileOutput{cfg: config.FileOutput{Path: path, TokenFile: "token"}}).read(ctx)
	require.NoError(t, err)
	require.True(t, st.outdated)
	st, err = (&fileOutput{cfg: config.FileOutput{Path: path}}).read(ctx)
	require.NoError(t, err)
	require.False(t, st.outdated, "records written before token files stay valid")
}

func TestATokenFileOutputRefusesAClientCertificate(t *testing.T) {
	t.Parallel()
	o := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(t.TempDir(), "kubeconfig"), TokenFile: "token"}}
	c := goldenCredential(t)
	c.Token = ""
	_, err := o.write(context.Background(), goldenMeta, c)
	require.ErrorContains(t, err, "needs a token")
}
