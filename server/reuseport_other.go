//go:build !unix

package server

import (
	"errors"
	"syscall"
)

// reusePortControl refuses: SO_REUSEPORT is a Unix socket option.
func reusePortControl(_, _ string, _ syscall.RawConn) error {
	return errors.New("ReusePort needs a Unix system")
}
