package broker

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/tokenbroker/tokenbroker/"

// coreImports is which packages of the core may import which, as
// docs/architecture.md draws it: every arrow points down, and a package
// imports no sibling it does not need. A new import is a decision made
// here and in the doc, never a side effect of a change.
var coreImports = map[string][]string{
	"broker/problem":    {"api/v1"},
	"broker/metrics":    nil,
	"broker/audit":      nil,
	"broker/objects":    nil,
	"broker/informer":   nil,
	"broker/limits":     {"api/v1", "broker/audit", "broker/lease", "broker/metrics", "broker/policy", "broker/problem"},
	"broker/lease":      {"api/v1", "broker/objects", "broker/problem"},
	"broker/policy":     {"api/schema", "api/v1", "broker/metrics", "broker/problem", "issuers", "pki"},
	"broker/kubeconfig": {"api/v1", "broker/policy", "issuers"},
	"broker/workload":   {"api/v1", "broker/audit", "broker/informer", "broker/objects", "broker/policy", "broker/problem", "pki"},
	"broker/tenants":    {"api/v1", "broker/audit", "broker/lease", "broker/metrics", "broker/objects", "broker/policy", "broker/problem"},
	"broker/enrollment": {"api/v1", "broker/audit", "broker/informer", "broker/limits", "broker/metrics", "broker/objects", "broker/policy", "broker/problem", "pki"},
	"broker/auditjoin":  {"broker/audit"},
	"broker/rbacrights": nil,
}

// imports reads the tokenbroker packages that the non-test files of dir
// (relative to the repository root) import.
func imports(t *testing.T, root, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, dir, "*.go"))
	require.NoError(t, err)
	var out []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		require.NoError(t, err)
		for _, imp := range file.Imports {
			p := strings.Trim(imp.Path.Value, `"`)
			if rest, ok := strings.CutPrefix(p, module); ok && !slices.Contains(out, rest) {
				out = append(out, rest)
			}
		}
	}
	slices.Sort(out)
	return out
}

// TestTheCoreImportsPointOneWay checks every package under broker/ against
// coreImports, and that the lease package, which the gateway will read
// leases and learn of their revocation through, reaches no policy,
// enrollment or issuer code even indirectly.
func TestTheCoreImportsPointOneWay(t *testing.T) {
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	entries, err := os.ReadDir(".")
	require.NoError(t, err)
	for _, e := range entries {
		if !e.IsDir() || e.Name() == "testdata" {
			continue
		}
		pkg := "broker/" + e.Name()
		require.True(t, hasPackageDoc(t, filepath.Join(root, pkg)), "%s has no package doc comment stating its one job", pkg)
		allowed, ok := coreImports[pkg]
		require.True(t, ok, "%s is not in coreImports (and docs/architecture.md)", pkg)
		for _, imp := range imports(t, root, pkg) {
			require.Contains(t, allowed, imp, "%s imports %s, which coreImports does not allow", pkg, imp)
		}
	}

	// Everything the lease package reaches, transitively.
	seen := map[string]bool{}
	var walk func(string)
	walk = func(pkg string) {
		if seen[pkg] {
			return
		}
		seen[pkg] = true
		for _, imp := range imports(t, root, pkg) {
			walk(imp)
		}
	}
	walk("broker/lease")
	for pkg := range seen {
		for _, banned := range []string{"broker/policy", "broker/enrollment", "issuers"} {
			require.False(t, pkg == banned || strings.HasPrefix(pkg, banned+"/"), "broker/lease reaches %s", pkg)
		}
	}
}

// hasPackageDoc reports whether a non-test file of dir has a package doc
// comment.
func hasPackageDoc(t *testing.T, dir string) bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	require.NoError(t, err)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.PackageClauseOnly|parser.ParseComments)
		require.NoError(t, err)
		if file.Doc != nil {
			return true
		}
	}
	return false
}
