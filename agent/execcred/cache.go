package execcred

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// ErrUnsafeCache is wrapped when the cache directory or a cache file could
// be read by someone else (group or other permissions, another owner). The
// plugin refuses to go on rather than repair it: a credential in such a
// file may already have been read, and the person should know.
var ErrUnsafeCache = errors.New("unsafe credential cache")

const (
	// entryVersion is the version of the cache file format; a file of
	// another version is a miss and is overwritten.
	entryVersion = 1
	// maxEntryBytes bounds a cache file: a token or a certificate and key
	// are a few kilobytes.
	maxEntryBytes = 64 << 10
	// maxServedTo bounds the parents recorded per entry; see Plugin.
	maxServedTo = 16
	// DefaultLockTimeout is how long an invocation waits for another that
	// holds the entry's lock (and is asking the broker, whose client gives
	// up after 30 s) before it gives up.
	DefaultLockTimeout = time.Minute
)

// Cache keeps credentials in a private directory, one file per Key:
// <id>.json (mode 0600) with the credential, and <id>.lock, the file
// locked around every read-decide-write. Files are replaced atomically (a
// temporary file in the directory, then rename), so a reader sees the old
// entry or the new one; a file that does not decode, of another format
// version or for another key is a miss and is overwritten, never an error.
type Cache struct {
	dir string
	uid int
	// privateGroup reports whether gid is the current user's private
	// group (see checkParent).
	privateGroup func(gid int) bool
	// lockTimeout bounds the wait for another invocation's lock.
	lockTimeout time.Duration
}

// OpenCache creates dir (mode 0700) if it does not exist and checks that
// it is a directory of the current user that group and others cannot
// enter; otherwise the error wraps ErrUnsafeCache and says how to fix it.
// dir must be absolute: client-go runs the plugin in the caller's working
// directory.
//
// pinniped and kubelogin make their cache directories 0700 and their files
// 0600, as this cache does; it also refuses what would let another user
// put a directory of their choosing in its place, much as OpenSSH's
// StrictModes does for ~/.ssh: dir must not be a symbolic link (it is
// looked at with Lstat), and its parent must belong to the current user or
// to root and not be writable by everyone, unless it has the sticky bit
// (as /tmp has), which keeps others from renaming what is in it; a parent
// its group may write must be the user's own, with the user's private
// group (see checkParent).
func OpenCache(dir string) (*Cache, error) {
	return openCache(dir, os.Geteuid(), userPrivateGroup(os.Geteuid(), os.Getegid()))
}

// openCache is OpenCache for the user uid whose private group
// privateGroup recognizes.
func openCache(dir string, uid int, privateGroup func(gid int) bool) (*Cache, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("the cache directory %q must be an absolute path", dir)
	}
	dir = filepath.Clean(dir)
	c := &Cache{dir: dir, uid: uid, privateGroup: privateGroup, lockTimeout: DefaultLockTimeout}
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return nil, fmt.Errorf("create the cache directory: %w", err)
	}
	if err := c.checkParent(); err != nil {
		return nil, err
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("create the cache directory: %w", err)
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("the cache directory: %w", err)
	}
	if st.Mode()&fs.ModeSymlink != 0 {
		return nil, fmt.Errorf("%w: the cache directory %s is a symbolic link; use --cache-dir with the directory itself", ErrUnsafeCache, dir)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("the cache directory %s is not a directory", dir)
	}
	if owner, ok := fileOwner(st); ok && owner != c.uid {
		return nil, fmt.Errorf("%w: the cache directory %s belongs to uid %d, not to you (uid %d); use --cache-dir with a directory of your own", ErrUnsafeCache, dir, owner, c.uid)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%w: the cache directory %s has mode %04o, open to group or others; make it private with chmod 700 %s", ErrUnsafeCache, dir, perm, dir)
	}
	return c, nil
}

// checkParent refuses a parent directory someone else could replace the
// cache directory in: one that belongs to another user than the current
// one or root, or that everyone may write without the sticky bit, or that
// its group may write without the sticky bit unless it is the user's own
// and its group the user's private group. That exception is for user
// private groups (as Debian and its derivatives make them): with a umask
// of 002, ~/.cache is 0775 and its group holds the user alone. A shared
// group — a root-owned directory of group staff, a home of group users —
// could let its other members replace the cache directory.
func (c *Cache) checkParent() error {
	parent := filepath.Dir(c.dir)
	st, err := os.Stat(parent)
	if err != nil {
		return fmt.Errorf("the cache directory's parent: %w", err)
	}
	owner, ok := fileOwner(st)
	if ok && owner != c.uid && owner != 0 {
		return fmt.Errorf("%w: the cache directory's parent %s belongs to uid %d, who could replace the cache directory; use --cache-dir with a directory in one of your own", ErrUnsafeCache, parent, owner)
	}
	sticky := st.Mode()&fs.ModeSticky != 0
	if st.Mode().Perm()&0o002 != 0 && !sticky {
		return fmt.Errorf("%w: the cache directory's parent %s has mode %04o: anyone could replace the cache directory; make it writable by you alone (chmod o-w %s) or use --cache-dir", ErrUnsafeCache, parent, st.Mode().Perm(), parent)
	}
	if st.Mode().Perm()&0o020 != 0 && !sticky && ok {
		group, _ := fileGroup(st)
		if owner != c.uid || c.privateGroup == nil || !c.privateGroup(group) {
			return fmt.Errorf("%w: the cache directory's parent %s has mode %04o and group %d, not your own private group: its other members could replace the cache directory; make it writable by you alone (chmod g-w %s) or use --cache-dir", ErrUnsafeCache, parent, st.Mode().Perm(), group, parent)
		}
	}
	return nil
}

// userPrivateGroup recognizes the private group of the user uid whose
// effective gid is egid: that gid, the user's primary group in the user
// database, named like the user. A user or group the database does not
// know has none.
func userPrivateGroup(uid, egid int) func(gid int) bool {
	return func(gid int) bool {
		if gid != egid {
			return false
		}
		u, err := user.LookupId(strconv.Itoa(uid))
		if err != nil || u.Gid != strconv.Itoa(gid) {
			return false
		}
		g, err := user.LookupGroupId(strconv.Itoa(gid))
		return err == nil && g.Name == u.Username
	}
}

// Dir is the cache's directory.
func (c *Cache) Dir() string { return c.dir }

// Path is the file of the entry with the given id (Key.ID).
func (c *Cache) Path(id string) string { return filepath.Join(c.dir, id+".json") }

func (c *Cache) lockPath(id string) string { return filepath.Join(c.dir, id+".lock") }

// lock takes the exclusive lock of id's entry, waiting at most the lock
// timeout, and returns the function that releases it.
func (c *Cache) lock(ctx context.Context, id string) (func(), error) {
	ctx, cancel := context.WithTimeout(ctx, c.lockTimeout)
	defer cancel()
	unlock, err := lockFile(ctx, c.lockPath(id))
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return nil, fmt.Errorf("another tokenbroker credential has held the cache lock %s for over %s", c.lockPath(id), c.lockTimeout)
	case err != nil:
		return nil, fmt.Errorf("lock the cache: %w", err)
	}
	return unlock, nil
}

// loadState says what load found.
type loadState int

const (
	stateMissing loadState = iota // no file
	stateFound                    // a usable entry
	stateCorrupt                  // a file that is no usable entry of this key and version
)

// load reads id's entry. An unsafe file is an error wrapping
// ErrUnsafeCache; a file that cannot be used is stateCorrupt, with no
// error.
func (c *Cache) load(id string) (*entry, loadState, error) {
	path := c.Path(id)
	data, st, err := pki.ReadFileLimitStat(path, maxEntryBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, stateMissing, nil
	}
	if st != nil {
		if owner, ok := fileOwner(st); ok && owner != c.uid {
			return nil, 0, fmt.Errorf("%w: the cache file %s belongs to uid %d, not to you (uid %d); delete it (rm %s)", ErrUnsafeCache, path, owner, c.uid, path)
		}
		if perm := st.Mode().Perm(); perm&0o077 != 0 {
			return nil, 0, fmt.Errorf("%w: the cache file %s has mode %04o: group or others could read the credential in it; delete it (rm %s), a new one is made with mode 0600", ErrUnsafeCache, path, perm, path)
		}
	}
	if err != nil {
		if st != nil { // too large, or not a regular file
			return nil, stateCorrupt, nil
		}
		return nil, 0, fmt.Errorf("read the cache: %w", err)
	}
	e, ok := decodeEntry(data, id)
	if !ok {
		return nil, stateCorrupt, nil
	}
	return e, stateFound, nil
}

// store replaces e's file atomically, with mode 0600.
func (c *Cache) store(e *entry) error {
	data, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("encode the cache entry: %w", err)
	}
	if err := pki.WriteFileAtomic(c.Path(e.Key), data, 0o600); err != nil {
		return fmt.Errorf("write the cache: %w", err)
	}
	return nil
}

// remove deletes id's entry, for a credential that must not be handed out
// again even if no new one can be issued.
func (c *Cache) remove(id string) error {
	if err := os.Remove(c.Path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the cache entry: %w", err)
	}
	return nil
}

// entry is the content of a cache file. Token and ClientKeyData are
// secrets; the file is the only place they are written.
type entry struct {
	Version int `json:"version"`
	// Key is the entry's id, checked on read, so that a file copied or
	// renamed to another entry's name is not used for it.
	Key     string `json:"key"`
	Broker  string `json:"broker"`
	LeaseID string `json:"leaseId"`

	Token                 string `json:"token,omitempty"`
	ClientCertificateData string `json:"clientCertificateData,omitempty"`
	ClientKeyData         string `json:"clientKeyData,omitempty"`

	ObtainedAt time.Time `json:"obtainedAt"`
	ExpiresAt  time.Time `json:"expiresAt"`
	// RefreshAt is when the credential stops being handed out and a new
	// one is issued; it is also the expirationTimestamp client-go gets.
	RefreshAt time.Time `json:"refreshAt"`
	// ServedTo are the processes the credential was handed to since it was
	// issued, the most recent last, at most maxServedTo.
	ServedTo []Parent `json:"servedTo,omitempty"`
	// Cluster is the cluster of the kubeconfig the credential came in,
	// for the token-theft guard on a cache hit; absent in entries written
	// before the guard, which a guarded invocation treats as a miss.
	Cluster *ClusterRef `json:"cluster,omitempty"`
}

// String describes the entry without its secrets.
func (e *entry) String() string {
	return fmt.Sprintf("cache entry{lease %s, refresh at %s}", e.LeaseID, e.RefreshAt.UTC().Format(time.RFC3339))
}

// GoString is String, so that %#v leaks nothing either.
func (e *entry) GoString() string { return e.String() }

// decodeEntry decodes a cache file and reports whether it is a usable
// entry of this format version for id.
func decodeEntry(data []byte, id string) (*entry, bool) {
	var e entry
	if err := json.Unmarshal(data, &e); err != nil {
		return nil, false
	}
	cert := e.ClientCertificateData != "" && e.ClientKeyData != ""
	switch {
	case e.Version != entryVersion, e.Key != id, !apiv1.ValidLeaseID(e.LeaseID),
		e.Token == "" && !cert,
		e.ObtainedAt.IsZero(), !e.ObtainedAt.Before(e.RefreshAt), e.RefreshAt.After(e.ExpiresAt):
		return nil, false
	}
	if len(e.ServedTo) > maxServedTo {
		e.ServedTo = e.ServedTo[len(e.ServedTo)-maxServedTo:]
	}
	return &e, true
}

// servedTo reports whether the credential was handed to p.
func (e *entry) servedTo(p Parent) bool {
	for _, s := range e.ServedTo {
		if s == p {
			return true
		}
	}
	return false
}

// serve records that the credential is handed to p.
func (e *entry) serve(p Parent) {
	if !p.Known() || e.servedTo(p) {
		return
	}
	e.ServedTo = append(e.ServedTo, p)
	if len(e.ServedTo) > maxServedTo {
		e.ServedTo = e.ServedTo[len(e.ServedTo)-maxServedTo:]
	}
}

func (e *entry) credential() *Credential {
	return &Credential{
		LeaseID:               e.LeaseID,
		Token:                 e.Token,
		ClientCertificateData: e.ClientCertificateData,
		ClientKeyData:         e.ClientKeyData,
		ObtainedAt:            e.ObtainedAt,
		ExpiresAt:             e.ExpiresAt,
		RefreshAt:             e.RefreshAt,
		Cluster:               e.Cluster,
	}
}

func newEntry(id, broker string, c *Credential) *entry {
	return &entry{
		Version:               entryVersion,
		Key:                   id,
		Broker:                broker,
		LeaseID:               c.LeaseID,
		Token:                 c.Token,
		ClientCertificateData: c.ClientCertificateData,
		ClientKeyData:         c.ClientKeyData,
		ObtainedAt:            c.ObtainedAt.UTC(),
		ExpiresAt:             c.ExpiresAt.UTC(),
		RefreshAt:             c.RefreshAt.UTC(),
		Cluster:               c.Cluster,
	}
}
