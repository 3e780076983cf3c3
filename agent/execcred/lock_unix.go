//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly

package execcred

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// lockFile takes an exclusive flock(2) on path (created with mode 0600 if
// missing) and returns the function that releases it. flock locks belong
// to the open file, so two goroutines that each open the file exclude each
// other just as two processes do, and the kernel releases the lock of a
// process that dies. When ctx ends first, the waiting goroutine releases
// the lock as soon as it gets it.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	fd := int(f.Fd())
	release := func() {
		_ = flock(fd, unix.LOCK_UN)
		_ = f.Close()
	}
	err = flock(fd, unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		return release, nil
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		_ = f.Close()
		return nil, fmt.Errorf("flock %s: %w", path, err)
	}
	done := make(chan error, 1)
	go func() { done <- flock(fd, unix.LOCK_EX) }()
	select {
	case err := <-done:
		if err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("flock %s: %w", path, err)
		}
		return release, nil
	case <-ctx.Done():
		go func() {
			if <-done == nil {
				release()
			} else {
				_ = f.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// flock is unix.Flock, retried when a signal interrupts the wait.
func flock(fd, how int) error {
	for {
		if err := unix.Flock(fd, how); !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// fileOwner returns the uid that owns a file.
func fileOwner(st fs.FileInfo) (int, bool) {
	s, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return int(s.Uid), true
}

// fileGroup returns the gid of a file's group.
func fileGroup(st fs.FileInfo) (int, bool) {
	s, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return int(s.Gid), true
}
