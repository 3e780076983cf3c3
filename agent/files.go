package agent

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// maxOutputFileBytes bounds what the agent reads back from its own files;
// a kubeconfig is a few kilobytes.
const maxOutputFileBytes = 1 << 20

// WriteKubeconfigFile writes a kubeconfig to path with mode 0600,
// atomically (a temporary file in the same directory, fsync, rename, fsync
// of the directory), so that a reader sees the old file or the new one,
// never a part. It writes only when the content differs (or the mode is
// not 0600) and reports whether it wrote. It is the file output of the
// agent and of "tokenbroker get kubeconfig -o FILE". The directory must
// exist: a missing shared volume is an error, not something to create.
func WriteKubeconfigFile(path string, kubeconfig []byte) (written bool, err error) {
	return writeFileIfChanged(path, kubeconfig, 0o600)
}

func writeFileIfChanged(path string, data []byte, mode fs.FileMode) (bool, error) {
	old, st, err := readFileBounded(path, maxOutputFileBytes)
	if err == nil && bytes.Equal(old, data) && st.Mode().Perm() == mode && st.Mode().IsRegular() {
		return false, nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, errTooLarge) {
		return false, err
	}
	if err := writeFileAtomic(path, data, mode); err != nil {
		return false, err
	}
	return true, nil
}

var errTooLarge = errors.New("file too large")

// readFileBounded reads at most limit bytes of a regular file.
func readFileBounded(path string, limit int64) ([]byte, fs.FileInfo, error) {
	f, err := os.Open(path)
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
		return nil, st, fmt.Errorf("%s: %w (over %d bytes)", path, errTooLarge, limit)
	}
	return data, st, nil
}

// writeFileAtomic writes data to name through a temporary file in the same
// directory: mode set before any byte is written (so a key is never
// readable by others, not even briefly), fsync, rename, and fsync of the
// directory so that the rename survives a crash.
func writeFileAtomic(name string, data []byte, mode fs.FileMode) (err error) {
	dir := filepath.Dir(name)
	f, err := os.CreateTemp(dir, "."+filepath.Base(name)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	if err = f.Chmod(mode); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err = os.Rename(f.Name(), name); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return syncDir(dir)
}

// syncDir makes renames in dir durable. Filesystems that cannot sync a
// directory say so with EINVAL; that only weakens durability and is not an
// error.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
