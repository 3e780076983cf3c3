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
	FileReloader[tls.Certificate]
	certFile, keyFile string
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

// FileReloader is the one digest-and-swap mechanism of tokenbroker's
// files (the server certificate, the client-CA bundle, the broker's
// policy): a value parsed from files, read again at most every interval by
// the callers that use it (or on Reload), replaced only by a good parse of
// changed content, with every change (good or refused) reported to the
// callback once. CertReloader and PoolReloader are made of it.
type FileReloader[T any] struct {
	reloadSettings
	// read reads the files (bounded), wrapping errors with what it read.
	read func() ([][]byte, error)
	// parse turns the content into the value to serve, or refuses it.
	parse func([][]byte) (*T, error)
	// what names the files in parse errors.
	what string

	current atomic.Pointer[T]

	mu        sync.Mutex // guards lastCheck and lastSum; held while reading files
	lastCheck time.Time
	lastSum   [sha256.Size]byte
}

// load reads and parses the files for the first time; an error means no
// value to serve.
func (f *FileReloader[T]) load() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.reloadLocked()
	return err
}

// get returns the value in service after a reload if one is due.
func (f *FileReloader[T]) get() *T {
	f.maybeReload()
	return f.current.Load()
}

// NewFileReloader reads and parses the files now and fails if it cannot;
// later problems go to the callback. read reads the files (bounded) and
// wraps its errors with what it read; parse turns their content into the
// value to serve or refuses it; what names the files in parse errors.
func NewFileReloader[T any](what string, read func() ([][]byte, error), parse func([][]byte) (*T, error), opts ...ReloaderOption) (*FileReloader[T], error) {
	f := &FileReloader[T]{reloadSettings: newReloadSettings(opts), read: read, parse: parse, what: what}
	if err := f.load(); err != nil {
		return nil, err
	}
	return f, nil
}

// Current returns the value in service, without looking at the files.
func (f *FileReloader[T]) Current() *T { return f.current.Load() }

// Reload reads the files now, whatever the interval, and returns the outcome
// of a change: nil if the files are unchanged since the last attempt (a bad
// or unreadable state is reported once) or the new content went into
// service. The callback is called as for a polled reload.
func (f *FileReloader[T]) Reload() error {
	f.mu.Lock()
	changed, err := f.reloadLocked()
	f.mu.Unlock()
	if !changed {
		return nil
	}
	f.report(err)
	return err
}

func (f *FileReloader[T]) maybeReload() {
	// A caller (a handshake) never waits for another one's file read: it
	// gets the value in service.
	if !f.mu.TryLock() {
		return
	}
	// A clock that went backwards counts as time passed.
	if since := f.now().Sub(f.lastCheck); since >= 0 && since < f.interval {
		f.mu.Unlock()
		return
	}
	changed, err := f.reloadLocked()
	f.mu.Unlock()
	if changed {
		f.report(err)
	}
}

// reloadLocked reads the files and, if their content changed since the last
// attempt, tries to put them into service. It reports whether the content
// changed. Read errors are always reported as changes (a missing file is news
// every time), but only after a successful read changes the remembered sum.
func (f *FileReloader[T]) reloadLocked() (changed bool, err error) {
	f.lastCheck = f.now()
	content, err := f.read()
	if err != nil {
		if f.lastSum == ([sha256.Size]byte{}) {
			// Already reported an unreadable state; report only the first.
			return f.current.Load() == nil, err
		}
		// Cleared, so that the same good content, once readable again,
		// counts as a change and is reported.
		f.lastSum = [sha256.Size]byte{}
		return true, err
	}
	h := sha256.New()
	for _, c := range content {
		fmt.Fprintf(h, "%d\n", len(c))
		h.Write(c)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	if f.current.Load() != nil && sum == f.lastSum {
		return false, nil
	}
	f.lastSum = sum
	v, err := f.parse(content)
	if err != nil {
		return true, fmt.Errorf("reload %s: %w", f.what, err)
	}
	f.current.Store(v)
	return true, nil
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
	r := &CertReloader{certFile: certFile, keyFile: keyFile}
	r.FileReloader = FileReloader[tls.Certificate]{
		reloadSettings: newReloadSettings(opts),
		read:           r.readFiles,
		parse:          func(c [][]byte) (*tls.Certificate, error) { return r.parse(c[0], c[1]) },
		what:           certFile,
	}
	if err := r.load(); err != nil {
		return nil, err
	}
	return r, nil
}

// GetCertificate returns the current pair; it is the tls.Config hook for
// servers.
func (r *CertReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return r.get(), nil
}

// GetClientCertificate returns the current pair; it is the tls.Config hook for
// clients.
func (r *CertReloader) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return r.get(), nil
}

// Leaf returns the certificate in service, for expiry checks and metrics.
func (r *CertReloader) Leaf() *x509.Certificate {
	return r.get().Leaf
}

func (r *CertReloader) readFiles() ([][]byte, error) {
	certPEM, err := readFileLimited(r.certFile, MaxCertificatesPEMSize)
	if err != nil {
		return nil, fmt.Errorf("reload certificate: %w", err)
	}
	keyPEM, err := readFileLimited(r.keyFile, MaxPrivateKeyPEMSize)
	if err != nil {
		return nil, fmt.Errorf("reload key: %w", err)
	}
	return [][]byte{certPEM, keyPEM}, nil
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
