package pki

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultReloadInterval is how often, at most, a CertReloader reads its files
// again.
const DefaultReloadInterval = time.Second

// CertReloader serves a certificate and key read from files and picks up new
// files without a restart. It polls: a handshake that finds the last check
// older than the interval reads both files again (bounded reads), and if their
// content changed, parses and checks them. A bad new pair (unparsable,
// mismatched key and certificate, expired certificate) is refused and the old
// pair stays in service; the outcome goes to the callback. Writing the key and
// then the certificate (as KeyPair.WriteFiles does) is therefore safe: the
// half-written state is refused and the next check takes the complete pair.
// Polling also follows Kubernetes Secret volumes, which swap files through a
// symlink.
//
// A CertReloader is safe for concurrent use.
type CertReloader struct {
	reloadSettings
	certFile, keyFile string

	current atomic.Pointer[tls.Certificate]

	mu        sync.Mutex // guards lastCheck and lastSum; held while reading files
	lastCheck time.Time
	lastSum   [sha256.Size]byte
}

// reloadSettings are what ReloaderOptions set, shared by CertReloader and
// PoolReloader.
type reloadSettings struct {
	now      func() time.Time
	interval time.Duration
	onReload func(error)
}

func newReloadSettings(opts []ReloaderOption) reloadSettings {
	s := reloadSettings{now: time.Now, interval: DefaultReloadInterval}
	for _, o := range opts {
		o(&s)
	}
	if s.now == nil {
		s.now = time.Now
	}
	return s
}

func (s *reloadSettings) report(err error) {
	if s.onReload != nil {
		s.onReload(err)
	}
}

// ReloaderOption configures NewCertReloader and NewPoolReloader.
type ReloaderOption func(*reloadSettings)

// WithReloadCallback sets a function called after each reload attempt that saw
// changed files: with nil when a new pair went into service, with the error
// when the new files were refused. It is not called again for the same bad
// content. It runs on the handshake goroutine, so keep it quick; it must not
// call Reload.
func WithReloadCallback(fn func(err error)) ReloaderOption {
	return func(r *reloadSettings) { r.onReload = fn }
}

// WithReloadInterval sets how often, at most, the files are read again;
// zero checks on every handshake. The default is DefaultReloadInterval.
func WithReloadInterval(d time.Duration) ReloaderOption {
	return func(r *reloadSettings) { r.interval = d }
}

// WithReloadClock sets the clock used for the interval and for refusing
// expired certificates; the default is time.Now.
func WithReloadClock(now func() time.Time) ReloaderOption {
	return func(r *reloadSettings) { r.now = now }
}

// NewCertReloader loads the pair now and fails if it is bad; later bad files
// are reported to the callback instead. The certificate file may hold the leaf
// followed by intermediates (as KeyPair.CertPEM does for an intermediate CA);
// TLS then sends the whole chain.
func NewCertReloader(certFile, keyFile string, opts ...ReloaderOption) (*CertReloader, error) {
	r := &CertReloader{reloadSettings: newReloadSettings(opts), certFile: certFile, keyFile: keyFile}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.reloadLocked(); err != nil {
		return nil, err
	}
	return r, nil
}

// GetCertificate returns the current pair; it is the tls.Config hook for
// servers.
func (r *CertReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.maybeReload()
	return r.current.Load(), nil
}

// GetClientCertificate returns the current pair; it is the tls.Config hook for
// clients.
func (r *CertReloader) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	r.maybeReload()
	return r.current.Load(), nil
}

// Leaf returns the certificate in service, for expiry checks and metrics.
func (r *CertReloader) Leaf() *x509.Certificate {
	return r.current.Load().Leaf
}

// Reload reads the files now, whatever the interval, and returns the outcome
// (nil if the files are unchanged or the new pair went into service). The
// callback is called as for a polled reload.
func (r *CertReloader) Reload() error {
	r.mu.Lock()
	changed, err := r.reloadLocked()
	r.mu.Unlock()
	if changed {
		r.report(err)
	}
	return err
}

func (r *CertReloader) maybeReload() {
	// A handshake never waits for another one's file read: it serves the
	// current pair.
	if !r.mu.TryLock() {
		return
	}
	// A clock that went backwards counts as time passed.
	if since := r.now().Sub(r.lastCheck); since >= 0 && since < r.interval {
		r.mu.Unlock()
		return
	}
	changed, err := r.reloadLocked()
	r.mu.Unlock()
	if changed {
		r.report(err)
	}
}

// reloadLocked reads the files and, if their content changed since the last
// attempt, tries to put them into service. It reports whether the content
// changed. Read errors are always reported as changes (a missing file is news
// every time), but only after a successful read changes the remembered sum.
func (r *CertReloader) reloadLocked() (changed bool, err error) {
	r.lastCheck = r.now()
	certPEM, err := readFileLimited(r.certFile, MaxCertificatesPEMSize)
	if err != nil {
		return r.readFailed(fmt.Errorf("reload certificate: %w", err))
	}
	keyPEM, err := readFileLimited(r.keyFile, MaxPrivateKeyPEMSize)
	if err != nil {
		return r.readFailed(fmt.Errorf("reload key: %w", err))
	}
	h := sha256.New()
	fmt.Fprintf(h, "%d\n", len(certPEM))
	h.Write(certPEM)
	h.Write(keyPEM)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	if r.current.Load() != nil && sum == r.lastSum {
		return false, nil
	}
	r.lastSum = sum
	cert, err := r.parse(certPEM, keyPEM)
	if err != nil {
		return true, fmt.Errorf("reload %s: %w", r.certFile, err)
	}
	r.current.Store(cert)
	return true, nil
}

// readFailed records an unreadable file. The sum is cleared so that the same
// good content, once readable again, counts as a change and is reported.
func (r *CertReloader) readFailed(err error) (bool, error) {
	if r.lastSum == ([sha256.Size]byte{}) {
		// Already reported an unreadable state; report only the first.
		return r.current.Load() == nil, err
	}
	r.lastSum = [sha256.Size]byte{}
	return true, err
}

func (r *CertReloader) parse(certPEM, keyPEM []byte) (*tls.Certificate, error) {
	certs, err := ParseCertificatesPEM(certPEM)
	if err != nil {
		return nil, err
	}
	key, err := ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, err
	}
	leaf := certs[0]
	if err := matchKey(leaf, key); err != nil {
		return nil, err
	}
	if now := r.now(); now.After(leaf.NotAfter) {
		return nil, errors.New("certificate expired at " + leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	c := &tls.Certificate{PrivateKey: key, Leaf: leaf}
	for _, x := range certs {
		c.Certificate = append(c.Certificate, x.Raw)
	}
	return c, nil
}
