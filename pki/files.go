package pki

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

const (
	certFileMode fs.FileMode = 0o644
	keyFileMode  fs.FileMode = 0o600
)

// writePair writes a key file and a certificate file. With overwrite false it
// refuses (wrapping fs.ErrExist) when either exists and removes the key it
// wrote if the certificate cannot be written.
func writePair(certFile string, certPEM []byte, keyFile string, keyPEM []byte, overwrite bool) error {
	if certFile == "" || keyFile == "" {
		return errors.New("certificate and key file names are required")
	}
	if filepath.Clean(certFile) == filepath.Clean(keyFile) {
		return fmt.Errorf("certificate and key file are the same file %s", certFile)
	}
	if !overwrite {
		for _, f := range []string{certFile, keyFile} {
			if _, err := os.Lstat(f); err == nil {
				return fmt.Errorf("%s: %w (refusing to overwrite)", f, fs.ErrExist)
			} else if !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	if err := writeFileAtomic(keyFile, keyPEM, keyFileMode, overwrite); err != nil {
		return err
	}
	if err := writeFileAtomic(certFile, certPEM, certFileMode, overwrite); err != nil {
		if !overwrite {
			_ = os.Remove(keyFile)
		}
		return err
	}
	return nil
}

// writeFileAtomic writes data to a temporary file in name's directory with
// the given mode, syncs it and moves it into place, so that readers see the
// old file or the new one, never a part. Without overwrite the final step is
// a hard link, which fails if name exists, so a racing writer is not
// clobbered either.
func writeFileAtomic(name string, data []byte, mode fs.FileMode, overwrite bool) (err error) {
	dir := filepath.Dir(name)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(name)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	tmpName := tmp.Name()
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmpName)
		}
	}()
	// CreateTemp makes the file 0600, so a key is never readable by others,
	// not even briefly; Chmod is not subject to the umask.
	if err = tmp.Chmod(mode); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if _, err = tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if overwrite {
		if err = os.Rename(tmpName, name); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
	} else {
		if err = os.Link(tmpName, name); err != nil {
			if errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("write %s: %w (refusing to overwrite)", name, fs.ErrExist)
			}
			return fmt.Errorf("write %s: %w", name, err)
		}
		_ = os.Remove(tmpName)
	}
	return SyncDir(dir)
}

// WriteFileAtomic writes data to name with mode through a temporary file in
// the same directory: the mode is set before any byte is written (so a key
// is never readable by others, not even briefly), then fsync, rename over
// name, and fsync of the directory. A reader sees the old file or the new
// one, never a part. The agent writes kubeconfigs and identities with it.
func WriteFileAtomic(name string, data []byte, mode fs.FileMode) error {
	return writeFileAtomic(name, data, mode, true)
}

// SyncDir makes renames in dir durable. Filesystems that cannot sync a
// directory say so with EINVAL; that only weakens durability and is not an
// error.
func SyncDir(dir string) error {
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

// WriteCertificatesFile writes PEM certificates (a trust bundle or a chain)
// to name with mode 0644, atomically (temporary file and rename), so that a
// PoolReloader watching it sees the old bundle or the new one, never a part.
// Without overwrite it refuses, wrapping fs.ErrExist, if name exists.
func WriteCertificatesFile(name string, certPEM []byte, overwrite bool) error {
	if name == "" {
		return errors.New("write certificates: file name is required")
	}
	if err := writeFileAtomic(name, certPEM, certFileMode, overwrite); err != nil {
		return fmt.Errorf("write certificates: %w", err)
	}
	return nil
}
