package execcred

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseStatStartTime(t *testing.T) {
	t.Parallel()
	const tail = " S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 424242 20 21\n"
	for _, tc := range []struct {
		name, stat string
		want       uint64
		ok         bool
	}{
		{name: "field 22 of an ordinary line is the start time", stat: "4711 (kubectl)" + tail, want: 424242, ok: true},
		{name: "a command name with spaces and parentheses does not shift the fields", stat: "4711 (a) b (c) d)" + tail, want: 424242, ok: true},
		{name: "a line cut short has no start time", stat: "4711 (kubectl) S 1 2 3"},
		{name: "a line without a command name has no start time", stat: "4711 kubectl" + tail},
		{name: "a start time that is not a number is none", stat: "4711 (k) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 soon 20\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, ok := parseStatStartTime([]byte(tc.stat))
			require.Equal(t, tc.ok, ok)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParentOf(t *testing.T) {
	t.Parallel()
	proc := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(proc, "4711"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(proc, "4711", "stat"),
		[]byte("4711 (kubectl) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99 20\n"), 0o644))
	require.Equal(t, Parent{PID: 4711, StartTime: 99}, ParentOf(proc, 4711))
	require.Equal(t, Parent{PID: 4712}, ParentOf(proc, 4712), "without /proc the PID alone")
	require.False(t, ParentOf(proc, 1).Known(), "an orphan adopted by init has no parent to recognise")

	self := ParentOf("/proc", os.Getpid())
	if _, err := os.Stat("/proc/self/stat"); err == nil {
		require.NotZero(t, self.StartTime, "this process's start time is read from the real /proc")
	}
}
