package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/pki"
)

// errNoIdentity is wrapped when a store holds no identity yet: the agent
// then enrolls, if it may.
var errNoIdentity = errors.New("no identity stored")

// identityStore keeps the agent's identity across restarts: a directory or
// a Secret in the source cluster. Both write the certificate, the key and
// the bundle so that a reader never sees a key with another key's
// certificate.
type identityStore interface {
	// load returns the stored identity, or an error wrapping errNoIdentity.
	load(ctx context.Context) (*identity, error)
	save(ctx context.Context, id *identity) error
	String() string
}

// IdentityDir is a directory holding a client certificate, its key and the
// trust bundle, and optionally the cluster's CA (cluster-ca.crt and
// cluster-ca.key; absent or empty means none).
//
// The files are replaced together: the new ones are first written
// completely as .tls.key.next, .tls.crt.next, .cluster-ca.key.next,
// .cluster-ca.crt.next and .ca.crt.next (each through a temporary file,
// fsync and rename, in that order; the cluster CA's only if the identity
// has one or the directory holds one, which an empty file then replaces),
// then renamed over the old ones in the same order, and empty cluster CA
// files removed. Reading the directory finishes an interrupted
// replacement: if .tls.key.next is there, the staging was complete only
// if .tls.crt.next and .ca.crt.next, the last staged, are there too (else
// the staged files are dropped and the old identity stands); without
// .tls.key.next the renames had begun, and the remaining staged files are
// renamed. A crash therefore never leaves a key beside another key's
// certificate, nor a cluster CA beside another identity.
type IdentityDir string

// Cert, Key and Bundle return the paths of the identity's files.
func (d IdentityDir) Cert() string   { return filepath.Join(string(d), CertFile) }
func (d IdentityDir) Key() string    { return filepath.Join(string(d), KeyFile) }
func (d IdentityDir) Bundle() string { return filepath.Join(string(d), BundleFile) }

// ClusterCACert and ClusterCAKey return the paths of the cluster CA's
// files.
func (d IdentityDir) ClusterCACert() string { return filepath.Join(string(d), ClusterCACertFile) }
func (d IdentityDir) ClusterCAKey() string  { return filepath.Join(string(d), ClusterCAKeyFile) }

func (d IdentityDir) staged(name string) string {
	return filepath.Join(string(d), "."+name+".next")
}

// dirStore keeps the identity in an IdentityDir.
type dirStore struct {
	dir IdentityDir
	// workload also loads a pod certificate (a workload's clients, never
	// the agent's own identity).
	workload bool
}

var _ identityStore = dirStore{}

func (s dirStore) String() string { return "dir:" + string(s.dir) }

// identityFile is one file of an identity directory.
type identityFile struct {
	name string
	data []byte
	mode fs.FileMode
}

// stagingOrder is the order in which files are staged and renamed: the key
// first, so that a half-done replacement is recognised by it, the bundle
// last, so that a complete staging is recognised by it.
var stagingOrder = []string{KeyFile, CertFile, ClusterCAKeyFile, ClusterCACertFile, BundleFile}

// identityFiles lists the files of id in stagingOrder. Without a cluster
// CA, the cluster CA's files are empty (none) if the directory holds
// them, and left out otherwise.
func (s dirStore) identityFiles(id *identity) []identityFile {
	files := []identityFile{{KeyFile, id.keyPEM, 0o600}, {CertFile, id.certPEM, 0o644}}
	switch {
	case id.clusterCA != nil:
		files = append(files, identityFile{ClusterCAKeyFile, id.clusterCA.keyPEM, 0o600},
			identityFile{ClusterCACertFile, id.clusterCA.certPEM, 0o644})
	case s.exists(ClusterCAKeyFile) || s.exists(ClusterCACertFile):
		files = append(files, identityFile{ClusterCAKeyFile, nil, 0o600}, identityFile{ClusterCACertFile, nil, 0o644})
	}
	return append(files, identityFile{BundleFile, id.bundlePEM, 0o644})
}

func (s dirStore) exists(name string) bool {
	_, err := os.Lstat(filepath.Join(string(s.dir), name))
	return err == nil
}

func (s dirStore) save(_ context.Context, id *identity) error {
	if err := os.MkdirAll(string(s.dir), 0o700); err != nil {
		return fmt.Errorf("create %s: %w", s.dir, err)
	}
	// A replacement interrupted earlier is finished (or dropped) first, so
	// that the staged files below start from a clean state.
	if err := s.recover(); err != nil {
		return err
	}
	files := s.identityFiles(id)
	for _, f := range files {
		if err := pki.WriteFileAtomic(s.dir.staged(f.name), f.data, f.mode); err != nil {
			return fmt.Errorf("stage identity: %w", err)
		}
	}
	for _, f := range files {
		if err := os.Rename(s.dir.staged(f.name), filepath.Join(string(s.dir), f.name)); err != nil {
			return fmt.Errorf("replace identity: %w", err)
		}
	}
	if err := s.dropEmptyClusterCA(); err != nil {
		return fmt.Errorf("replace identity: %w", err)
	}
	if err := pki.SyncDir(string(s.dir)); err != nil {
		return fmt.Errorf("replace identity: %w", err)
	}
	return nil
}

// dropEmptyClusterCA removes the empty cluster CA files that replaced a
// cluster CA the new identity does not have.
func (s dirStore) dropEmptyClusterCA() error {
	for _, n := range []string{ClusterCACertFile, ClusterCAKeyFile} {
		p := filepath.Join(string(s.dir), n)
		if st, err := os.Lstat(p); err == nil && st.Mode().IsRegular() && st.Size() == 0 {
			if err := os.Remove(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// recover finishes or drops a replacement that a crash interrupted; see
// IdentityDir.
func (s dirStore) recover() error {
	staged := map[string]bool{}
	some := false
	for _, n := range stagingOrder {
		_, err := os.Lstat(s.dir.staged(n))
		staged[n] = err == nil
		some = some || staged[n]
	}
	if !some {
		return nil
	}
	if staged[KeyFile] && !(staged[CertFile] && staged[BundleFile]) {
		for _, n := range stagingOrder {
			if err := os.Remove(s.dir.staged(n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("drop incomplete identity: %w", err)
			}
		}
		return nil
	}
	for _, n := range stagingOrder {
		if !staged[n] {
			continue
		}
		if err := os.Rename(s.dir.staged(n), filepath.Join(string(s.dir), n)); err != nil {
			return fmt.Errorf("finish identity replacement: %w", err)
		}
	}
	if err := s.dropEmptyClusterCA(); err != nil {
		return fmt.Errorf("finish identity replacement: %w", err)
	}
	if err := pki.SyncDir(string(s.dir)); err != nil {
		return fmt.Errorf("finish identity replacement: %w", err)
	}
	return nil
}

func (s dirStore) load(context.Context) (*identity, error) {
	if _, err := os.Stat(string(s.dir)); errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", s.dir, errNoIdentity)
	}
	if err := s.recover(); err != nil {
		return nil, err
	}
	read := func(name string, limit int64) ([]byte, error) {
		data, _, err := pki.ReadFileLimitStat(filepath.Join(string(s.dir), name), limit)
		return data, err
	}
	certPEM, certErr := read(CertFile, pki.MaxCertificatesPEMSize)
	keyPEM, keyErr := read(KeyFile, pki.MaxPrivateKeyPEMSize)
	if errors.Is(certErr, fs.ErrNotExist) && errors.Is(keyErr, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", s.dir, errNoIdentity)
	}
	if err := errors.Join(certErr, keyErr); err != nil {
		return nil, fmt.Errorf("read identity: %w", err)
	}
	bundlePEM, err := read(BundleFile, pki.MaxCertificatesPEMSize)
	if err != nil {
		return nil, fmt.Errorf("read identity: %w", err)
	}
	id, err := parseIdentityAs(certPEM, keyPEM, bundlePEM, s.workload)
	if err != nil {
		return nil, fmt.Errorf("identity in %s: %w", s.dir, err)
	}
	caCert, caCertErr := read(ClusterCACertFile, pki.MaxCertificatesPEMSize)
	caKey, caKeyErr := read(ClusterCAKeyFile, pki.MaxPrivateKeyPEMSize)
	for _, err := range []error{caCertErr, caKeyErr} {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("read identity: %w", err)
		}
	}
	if id, err = loadClusterCA(id, caCert, caKey); err != nil {
		return nil, fmt.Errorf("identity in %s: %w", s.dir, err)
	}
	return id, nil
}

// loadClusterCA returns id with the stored cluster CA of certPEM and
// keyPEM, or id itself when both are empty (none stored).
func loadClusterCA(id *identity, certPEM, keyPEM []byte) (*identity, error) {
	switch {
	case len(certPEM) == 0 && len(keyPEM) == 0:
		return id, nil
	case len(certPEM) == 0:
		return nil, fmt.Errorf("%s without %s", ClusterCAKeyFile, ClusterCACertFile)
	case len(keyPEM) == 0:
		return nil, fmt.Errorf("%s without %s", ClusterCACertFile, ClusterCAKeyFile)
	}
	return id.withClusterCA(certPEM, keyPEM, time.Time{})
}

// secretStore keeps the identity in a Secret of the source cluster, so
// that a Deployment keeps it across restarts without a volume. A Secret is
// replaced in one update, so its keys (tls.crt, tls.key, ca.crt and, with
// a cluster CA, cluster-ca.crt and cluster-ca.key) always belong together.
type secretStore struct {
	secrets corev1client.SecretsGetter
	ref     config.ObjectRef
}

var _ identityStore = secretStore{}

func (s secretStore) String() string { return "secret:" + s.ref.Namespace + "/" + s.ref.Name }

func (s secretStore) load(ctx context.Context) (*identity, error) {
	sec, err := s.secrets.Secrets(s.ref.Namespace).Get(ctx, s.ref.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, errNoIdentity)
	}
	if err != nil {
		return nil, fmt.Errorf("get identity Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, err)
	}
	// A Secret made empty ahead of time (so that RBAC can name it) holds
	// no identity yet.
	if len(sec.Data[CertFile]) == 0 && len(sec.Data[KeyFile]) == 0 {
		return nil, fmt.Errorf("Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, errNoIdentity)
	}
	for _, k := range []string{CertFile, KeyFile, BundleFile} {
		if len(sec.Data[k]) == 0 {
			return nil, fmt.Errorf("identity Secret %s/%s has no %s", s.ref.Namespace, s.ref.Name, k)
		}
	}
	id, err := parseIdentity(sec.Data[CertFile], sec.Data[KeyFile], sec.Data[BundleFile])
	if err == nil {
		id, err = loadClusterCA(id, sec.Data[ClusterCACertFile], sec.Data[ClusterCAKeyFile])
	}
	if err != nil {
		return nil, fmt.Errorf("identity Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, err)
	}
	return id, nil
}

func (s secretStore) save(ctx context.Context, id *identity) error {
	api := s.secrets.Secrets(s.ref.Namespace)
	data := map[string][]byte{CertFile: id.certPEM, KeyFile: id.keyPEM, BundleFile: id.bundlePEM}
	if id.clusterCA != nil {
		data[ClusterCACertFile], data[ClusterCAKeyFile] = id.clusterCA.certPEM, id.clusterCA.keyPEM
	}
	cur, err := api.Get(ctx, s.ref.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err := api.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: s.ref.Namespace,
				Name:      s.ref.Name,
				Labels:    map[string]string{config.LabelManagedBy: config.ManagedByAgent},
			},
			Type: corev1.SecretTypeTLS,
			Data: data,
		}, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("create identity Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("get identity Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, err)
	}
	// The type stays as it is: it cannot change, and an Opaque Secret made
	// ahead of time serves as well.
	upd := cur.DeepCopy()
	if upd.Data == nil {
		upd.Data = map[string][]byte{}
	}
	for k, v := range data {
		upd.Data[k] = v
	}
	// The cluster CA keys are the agent's own: an identity without a
	// cluster CA leaves none of another identity behind.
	if id.clusterCA == nil {
		delete(upd.Data, ClusterCACertFile)
		delete(upd.Data, ClusterCAKeyFile)
	}
	if _, err := api.Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update identity Secret %s/%s: %w", s.ref.Namespace, s.ref.Name, err)
	}
	return nil
}
