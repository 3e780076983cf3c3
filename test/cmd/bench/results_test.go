package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWriteResultsKey(t *testing.T) {
	t.Parallel()
	type scale struct {
		Leases int `json:"leases"`
	}
	// As make bench writes it: json.MarshalIndent with two spaces, keys
	// out of alphabetical order, HTML characters escaped.
	type report struct {
		Results any     `json:"results"`
		Ready   float64 `json:"ready_ms"`
	}
	rows := []map[string]any{{"name": "direct <TokenRequest>", "p50_ms": 1.523}}
	written, err := json.MarshalIndent(report{rows, 12.5}, "", "  ")
	require.NoError(t, err)

	t.Run("A new key is added after the others, which keep their bytes.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "results.json")
		require.NoError(t, os.WriteFile(file, append(written, '\n'), 0o644))
		require.NoError(t, writeResultsKey(file, "scale", scale{Leases: 1000}))
		got, err := os.ReadFile(file)
		require.NoError(t, err)
		want, err := json.MarshalIndent(struct {
			report
			Scale scale `json:"scale"`
		}{report{rows, 12.5}, scale{1000}}, "", "  ")
		require.NoError(t, err)
		require.Equal(t, string(want)+"\n", string(got))
	})

	t.Run("An existing key is replaced in place and the others are kept in their order.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "results.json")
		require.NoError(t, os.WriteFile(file, []byte(`{"vault": {"p50_ms": 1}, "scale": {"leases": 1}, "agent": [1, 2]}`), 0o644))
		require.NoError(t, writeResultsKey(file, "scale", scale{Leases: 50000}))
		got, err := os.ReadFile(file)
		require.NoError(t, err)
		require.Equal(t, "{\n  \"vault\": {\n    \"p50_ms\": 1\n  },\n  \"scale\": {\n    \"leases\": 50000\n  },\n  \"agent\": [\n    1,\n    2\n  ]\n}\n", string(got))
	})

	t.Run("Each key of a report is set and the keys it does not have are kept.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "results.json")
		require.NoError(t, os.WriteFile(file, []byte(`{"results": [], "scale": {"leases": 1}}`), 0o644))
		require.NoError(t, writeResultsKeys(file, report{rows, 3}))
		got, err := os.ReadFile(file)
		require.NoError(t, err)
		require.JSONEq(t, `{"results": [{"name": "direct <TokenRequest>", "p50_ms": 1.523}], "scale": {"leases": 1}, "ready_ms": 3}`, string(got))
	})

	t.Run("A missing file becomes an object with the one key.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "bench", "results.json")
		require.NoError(t, writeResultsKey(file, "scale", scale{Leases: 1}))
		got, err := os.ReadFile(file)
		require.NoError(t, err)
		require.JSONEq(t, `{"scale": {"leases": 1}}`, string(got))
	})

	t.Run("A file that is not a JSON object is left alone.", func(t *testing.T) {
		t.Parallel()
		for _, content := range []string{`[1]`, `{"a": 1} {"b": 2}`, `{"a": `} {
			file := filepath.Join(t.TempDir(), "results.json")
			require.NoError(t, os.WriteFile(file, []byte(content), 0o644))
			require.Error(t, writeResultsKey(file, "scale", scale{}), content)
			got, err := os.ReadFile(file)
			require.NoError(t, err)
			require.Equal(t, content, string(got))
		}
	})
}
