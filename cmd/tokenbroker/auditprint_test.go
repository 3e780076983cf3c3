package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
)

// auditColumns is the number of columns of the audit table.
const auditColumns = 12

// requireOneSafeLinePerRow checks the printer's property: out has no
// control byte but the newlines ending its lines, is valid UTF-8, and has
// one header and rows lines of auditColumns whitespace-separated fields.
func requireOneSafeLinePerRow(t testing.TB, out string, rows int) {
	t.Helper()
	require.True(t, utf8.ValidString(out), "%q", out)
	for _, r := range out {
		if r == '\n' {
			continue
		}
		require.False(t, r < 0x20 || (r >= 0x7f && r <= 0x9f), "control character %U in %q", r, out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, rows+1, out)
	for _, l := range lines {
		require.Len(t, strings.Fields(l), auditColumns, "%q", l)
	}
}

func printRows(t testing.TB, rows ...auditjoin.Row) string {
	t.Helper()
	var out bytes.Buffer
	p := &rowPrinter{out: &out}
	for _, r := range rows {
		require.NoError(t, p.row(r))
	}
	require.NoError(t, p.flush())
	return out.String()
}

func TestAuditTablePrintsAttackerControlledFieldsEscapedOnOneLine(t *testing.T) {
	t.Parallel()
	real := auditjoin.Row{Time: time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC), Verb: "get", Resource: "configmaps", Namespace: "argo", Name: "hello", Code: 200,
		LeaseState: "live", Lease: auditjoin.Lease{ID: "aaaaaaaaaaaaaaaaaaaaaaaaaa", Peer: "west"}}
	// A lease holder asks for a configmap whose name (percent-decoded in
	// the objectRef) erases the line and forges a row blaming another lease.
	forged := real
	forged.Name = "x\x1b[2K\r\n2030-01-01T10:00:00Z\tdelete\tsecrets\tkube-system\tall\t200\tbbbbbbbbbbbbbbbbbbbbbbbbbb\tlive\teast\t<none>\t<none>"
	forged.Namespace = "a b"
	forged.Lease.Workload = "w\x7f\xc2\x9b\xff"
	forged.Lease.Peer = "\u2028west"
	out := printRows(t, real, forged)
	requireOneSafeLinePerRow(t, out, 2)
	require.Contains(t, out, `"x\x1b[2K\r\n2030-01-01T10:00:00Z\tdelete`)
	require.Contains(t, out, `"a\x20b"`)
	require.Contains(t, out, `"w\x7f\u009b\xff"`)
	require.Contains(t, out, `"\u2028west"`)
	require.Contains(t, out, " hello ", "a plain field is printed as it is")
}

func TestAuditSummaryPrintsAttackerControlledFieldsEscaped(t *testing.T) {
	t.Parallel()
	sum := auditjoin.NewSummary()
	sum.Add(auditjoin.Row{Time: time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC), Verb: "get", Resource: "configmaps\n  get\tsecrets", Code: 200,
		LeaseState: "live", Lease: auditjoin.Lease{ID: "aaaaaaaaaaaaaaaaaaaaaaaaaa", Peer: "we\x1bst", Grant: "g\r", Namespace: "argo", ServiceAccount: "run\nner",
			Credential: "token", IssueRequestID: "\x1b]0;x\x07", Workload: "\t"}})
	var out bytes.Buffer
	require.NoError(t, printSummary(t.Context(), &out, "table", sum, nil))
	s := out.String()
	for _, r := range s {
		require.False(t, r != '\n' && (r < 0x20 || r == 0x7f), "control character %U in %q", r, s)
	}
	require.Contains(t, s, `"configmaps\n\x20\x20get\tsecrets"`)
	require.Contains(t, s, `peer "we\x1bst"`)
	require.Contains(t, s, `GRANT "g\r"`)
	require.NotContains(t, s, "\n  get\tsecrets")
}

func FuzzAuditTableRow(f *testing.F) {
	f.Add("argo", "hello\n\x1b[2K", "west", "", "/api\t", "\xff")
	f.Add("", "", "", "configmaps", "", "a b")
	f.Fuzz(func(t *testing.T, ns, name, peer, resource, path, workload string) {
		r := auditjoin.Row{Time: time.Unix(0, 0), Verb: "get", Namespace: ns, Name: name, Resource: resource, Path: path, Code: 200,
			LeaseState: "live", Lease: auditjoin.Lease{ID: "aaaaaaaaaaaaaaaaaaaaaaaaaa", Peer: peer, Workload: workload}}
		requireOneSafeLinePerRow(t, printRows(t, r, r), 2)
		// and JSON stays one line
		b, err := json.Marshal(r)
		require.NoError(t, err)
		require.NotContains(t, string(b), "\n")
	})
}
