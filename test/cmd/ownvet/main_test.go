package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestOwnvetReportsWhatGoVetReportsButForThirdPartyWrappers vets a module
// with three printf mistakes: one through fmt, one through a wrapper of
// this repository's own packages, one through a third-party wrapper. go
// vet finds all three; ownvet the first two, and says so in its version.
func TestOwnvetReportsWhatGoVetReportsButForThirdPartyWrappers(t *testing.T) {
	dir := t.TempDir()
	tool := filepath.Join(dir, "ownvet")
	build := exec.Command("go", "build", "-o", tool, ".")
	out, err := build.CombinedOutput()
	require.NoError(t, err, string(out))

	write := func(name, content string) {
		p := filepath.Join(dir, "m", name)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
	}
	write("go.mod", "module github.com/tokenbroker/tokenbroker/vetted\n\ngo 1.24\n\nrequire example.com/dep v0.0.0\n\nreplace example.com/dep => ./dep\n")
	write("dep/go.mod", "module example.com/dep\n\ngo 1.24\n")
	write("dep/dep.go", "package dep\n\nimport \"fmt\"\n\nfunc Logf(format string, args ...any) { fmt.Printf(format, args...) }\n")
	write("own/own.go", "package own\n\nimport \"fmt\"\n\nfunc Logf(format string, args ...any) { fmt.Printf(format, args...) }\n")
	write("main.go", `package main

import (
	"fmt"

	"example.com/dep"
	"github.com/tokenbroker/tokenbroker/vetted/own"
)

func main() {
	fmt.Printf("%d\n", "through fmt")
	own.Logf("%d\n", "through our wrapper")
	dep.Logf("%d\n", "through a third-party wrapper")
}
`)
	vet := func(args ...string) string {
		cmd := exec.Command("go", append([]string{"vet"}, append(args, ".")...)...)
		cmd.Dir = filepath.Join(dir, "m")
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		require.Error(t, err, "vet finds the mistakes")
		return string(out)
	}
	plain := vet()
	require.Contains(t, plain, "through fmt", plain)
	require.Contains(t, plain, "own.Logf format %d", plain)
	require.Contains(t, plain, "dep.Logf format %d", plain)

	own := vet("-vettool=" + tool)
	require.Contains(t, own, "fmt.Printf format %d", own)
	require.Contains(t, own, "own.Logf format %d", own)
	require.NotContains(t, own, "dep.Logf", own)

	v, err := exec.Command(tool, "-V=full").Output()
	require.NoError(t, err)
	require.True(t, strings.HasSuffix(strings.TrimSpace(string(v)), " ownvet-no-third-party-facts"), string(v))
}
