//go:build !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package execcred

import (
	"context"
	"errors"
	"io/fs"
)

// lockFile refuses: without flock(2) parallel invocations could each issue
// a credential and overwrite each other's cache file.
func lockFile(context.Context, string) (func(), error) {
	return nil, errors.New("the credential cache needs flock(2), which this system lacks; use --no-cache")
}

// fileOwner knows no owner here.
func fileOwner(fs.FileInfo) (int, bool) { return 0, false }

// fileGroup knows no group here.
func fileGroup(fs.FileInfo) (int, bool) { return 0, false }
