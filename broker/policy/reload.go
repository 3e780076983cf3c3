package policy

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/pki"
)

// DefaultReloadInterval is how often a Watcher looks at the
// policy file.
const DefaultReloadInterval = time.Second

// Watcher keeps a Store in step with a policy file: it reads
// the file (and the cluster CA file it names) every interval and, when
// their content changed, loads them as LoadFile does. A valid new
// policy replaces the old one at once; an invalid one is refused and the
// old one stays in force. Both outcomes are logged and counted in
// tokenbroker_config_reloads_total{config="policy"}, once per distinct
// content. It is a pki.FileReloader, the same digest-and-swap as the
// certificate reloaders. Polling, unlike inotify, also follows Kubernetes
// ConfigMap volumes, which swap files through a symlink.
type Watcher struct {
	files    *pki.FileReloader[Policy]
	store    *Store
	interval time.Duration
	// inForce is the reloader's policy last put into the store.
	inForce *Policy
}

// NewWatcher returns a watcher of the policy file at path that
// updates store. The content of the file now is taken as in force (the
// caller loaded it with LoadFile before); an error means it no longer
// loads. interval zero means DefaultReloadInterval; metrics may be
// nil.
func NewWatcher(path string, store *Store, log *zap.Logger, m *metrics.Metrics, interval time.Duration) (*Watcher, error) {
	if interval <= 0 {
		interval = DefaultReloadInterval
	}
	w := &Watcher{store: store, interval: interval}
	report := func(err error) {
		m.ObserveReload(metrics.ConfigPolicy, err)
		if err != nil {
			log.Error("policy reload refused; keeping the policy in force", zap.String("file", path), zap.Error(err))
			return
		}
		p := w.files.Current()
		log.Info("policy reloaded", zap.String("file", path), zap.String("cluster", p.Cluster.Name), zap.Int("peers", len(p.Peers)))
	}
	files, err := pki.NewFileReloader(path,
		func() ([][]byte, error) { return readPolicyFiles(path) },
		func(content [][]byte) (*Policy, error) {
			return policyFromFiles(path, content[0], content[1], content[2:])
		},
		pki.WithReloadCallback(report))
	if err != nil {
		return nil, err
	}
	w.files, w.inForce = files, files.Current()
	return w, nil
}

// Run polls until ctx is done.
func (w *Watcher) Run(ctx context.Context) {
	wait.UntilWithContext(ctx, func(context.Context) { _ = w.Check() }, w.interval)
}

// Check looks at the files once and reloads them if they changed. It
// returns the outcome of the reload, or nil when nothing changed.
func (w *Watcher) Check() error {
	err := w.files.Reload()
	if p := w.files.Current(); p != w.inForce {
		w.store.Store(p)
		w.inForce = p
	}
	return err
}

// readPolicyFiles reads the policy file, the cluster CA file it names
// (nil if it names none or the policy does not parse: policyFromFiles
// reports that) and the peers' jwksFiles, so that a changed key file
// reloads the policy like a changed CA file.
func readPolicyFiles(path string) ([][]byte, error) {
	data, err := pki.ReadFileLimit(path, maxPolicyBytes)
	if err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	var ca []byte
	var jwks [][]byte
	if p, err := Parse(data); err == nil {
		if p.Cluster.CAFile != "" {
			// A missing CA file is read as nothing and refused by
			// policyFromFiles; its later arrival changes the content.
			ca, _ = pki.ReadFileLimit(caFilePath(path, p.Cluster.CAFile), maxPolicyBytes)
		}
		jwks = readJWKSFiles(path, p)
	}
	return append([][]byte{data, ca}, jwks...), nil
}

// caFilePath resolves a policy's caFile: relative to the policy file.
func caFilePath(policyFile, caFile string) string {
	if filepath.IsAbs(caFile) {
		return caFile
	}
	return filepath.Join(filepath.Dir(policyFile), caFile)
}
