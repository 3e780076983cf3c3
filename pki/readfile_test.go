package pki

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestReadFileLimitBoundsWhileReading(t *testing.T) {
	dir := t.TempDir()
	ok := filepath.Join(dir, "ok")
	require.NoError(t, os.WriteFile(ok, []byte("12345"), 0o600))
	data, err := ReadFileLimit(ok, 5)
	require.NoError(t, err)
	require.Equal(t, "12345", string(data))

	_, err = ReadFileLimit(ok, 4)
	require.ErrorIs(t, err, ErrFileTooLarge)
	require.ErrorContains(t, err, "over 4 bytes")

	// A FIFO would block a stat-then-read loader forever; it is refused.
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	_, err = ReadFileLimit(fifo, 10)
	require.ErrorContains(t, err, "not a regular file")

	_, err = ReadFileLimit(filepath.Join(dir, "missing"), 10)
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestAJoinTokenIsReadTrimmedAndBounded(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(f, []byte("  abc.def.ghi\n"), 0o600))
	tok, err := ReadJoinToken(f, nil)
	require.NoError(t, err)
	require.Equal(t, "abc.def.ghi", tok)

	tok, err = ReadJoinToken("-", strings.NewReader("abc\r\n"))
	require.NoError(t, err)
	require.Equal(t, "abc", tok)

	_, err = ReadJoinToken("-", strings.NewReader(strings.Repeat("a", MaxJoinTokenBytes+1)))
	require.ErrorContains(t, err, "over")
	require.NoError(t, os.WriteFile(f, []byte(strings.Repeat("a", 3*MaxJoinTokenBytes)), 0o600))
	_, err = ReadJoinToken(f, nil)
	require.ErrorIs(t, err, ErrFileTooLarge)
	require.NoError(t, os.WriteFile(f, []byte("\n"), 0o600))
	_, err = ReadJoinToken(f, nil)
	require.ErrorContains(t, err, "empty")
	_, err = ReadJoinToken("-", nil)
	require.Error(t, err)
}
