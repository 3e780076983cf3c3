package broker

import (
	"context"
	"crypto/sha256"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/pki"
)

// DefaultPolicyReloadInterval is how often WatchPolicyFile looks at the
// policy file.
const DefaultPolicyReloadInterval = time.Second

// PolicyWatcher keeps a PolicyStore in step with a policy file: it reads
// the file (and the cluster CA file it names) every interval and, when
// their content changed, loads them with LoadPolicyFile. A valid new policy
// replaces the old one at once; an invalid one is refused and the old one
// stays in force. Both outcomes are logged and counted in
// tokenbroker_config_reloads_total{config="policy"}, once per distinct
// content. Polling, unlike inotify, also follows Kubernetes ConfigMap
// volumes, which swap files through a symlink.
type PolicyWatcher struct {
	path     string
	store    *PolicyStore
	log      *zap.Logger
	metrics  *Metrics
	interval time.Duration

	// sum is the digest of the content last loaded or refused.
	sum [sha256.Size]byte
}

// NewPolicyWatcher returns a watcher of the policy file at path that
// updates store. The content in force now is taken as already loaded: the
// caller loaded it with LoadPolicyFile before. interval zero means
// DefaultPolicyReloadInterval; metrics may be nil.
func NewPolicyWatcher(path string, store *PolicyStore, log *zap.Logger, metrics *Metrics, interval time.Duration) *PolicyWatcher {
	if interval <= 0 {
		interval = DefaultPolicyReloadInterval
	}
	w := &PolicyWatcher{path: path, store: store, log: log, metrics: metrics, interval: interval}
	w.sum = w.digest()
	return w
}

// Run polls until ctx is done.
func (w *PolicyWatcher) Run(ctx context.Context) {
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			w.Check()
		}
	}
}

// Check looks at the files once and reloads them if they changed. It
// returns the outcome of the reload, or nil when nothing changed.
func (w *PolicyWatcher) Check() error {
	// An unreadable file digests to zero, so it too is reported once, and
	// the same content once readable again counts as a change.
	sum := w.digest()
	if sum == w.sum {
		return nil
	}
	w.sum = sum
	p, err := LoadPolicyFile(w.path)
	if err != nil {
		w.metrics.ObserveReload(ConfigPolicy, err)
		w.log.Error("policy reload refused; keeping the policy in force",
			zap.String("file", w.path), zap.Error(err))
		return err
	}
	w.store.Store(p)
	w.metrics.ObserveReload(ConfigPolicy, nil)
	w.log.Info("policy reloaded",
		zap.String("file", w.path),
		zap.String("cluster", p.Cluster.Name),
		zap.Int("peers", len(p.Peers)))
	return nil
}

// digest hashes the policy file and the CA file it names; it is zero when
// the policy file cannot be read.
func (w *PolicyWatcher) digest() [sha256.Size]byte {
	h := sha256.New()
	data, err := pki.ReadFileLimit(w.path, maxPolicyBytes)
	if err != nil {
		return [sha256.Size]byte{}
	}
	h.Write(data)
	// The CA file may change on its own (a rotated API server CA). Parse
	// errors are LoadPolicyFile's to report.
	if p, err := ParsePolicy(data); err == nil && p.Cluster.CAFile != "" {
		caFile := p.Cluster.CAFile
		if !filepath.IsAbs(caFile) {
			caFile = filepath.Join(filepath.Dir(w.path), caFile)
		}
		ca, _ := pki.ReadFileLimit(caFile, maxPolicyBytes)
		h.Write([]byte{0})
		h.Write(ca)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}
