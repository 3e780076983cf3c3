package pki

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// ErrFileTooLarge is wrapped by ReadFileLimit when a file is over its
// limit.
var ErrFileTooLarge = errors.New("file too large")

// ReadFileLimit reads a regular file of at most limit bytes: the one
// bounded reader of every file tokenbroker reads (policy, agent config,
// certificates, keys, join tokens, its own outputs). It bounds while
// reading, so a file that grows after it was opened is still cut off, and
// refuses what is not a regular file (a FIFO or a device could block or
// never end).
func ReadFileLimit(path string, limit int64) ([]byte, error) {
	data, _, err := ReadFileLimitStat(path, limit)
	return data, err
}

// ReadFileLimitStat is ReadFileLimit that also returns what the open file
// is (nil if it could not be opened), for callers that compare modes.
func ReadFileLimitStat(path string, limit int64) ([]byte, fs.FileInfo, error) {
	// O_NONBLOCK so that opening a FIFO does not wait for a writer; it
	// changes nothing for a regular file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, st, fmt.Errorf("%s is not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, st, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, st, fmt.Errorf("%s: %w: over %d bytes, the limit", path, ErrFileTooLarge, limit)
	}
	return data, st, nil
}
