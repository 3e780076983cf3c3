package agent

import (
	"bytes"
	"errors"
	"io/fs"

	"github.com/tokenbroker/tokenbroker/pki"
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
	old, st, err := pki.ReadFileLimitStat(path, maxOutputFileBytes)
	if err == nil && bytes.Equal(old, data) && st.Mode().Perm() == mode && st.Mode().IsRegular() {
		return false, nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, pki.ErrFileTooLarge) {
		return false, err
	}
	if err := pki.WriteFileAtomic(path, data, mode); err != nil {
		return false, err
	}
	return true, nil
}
