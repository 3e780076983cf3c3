// Package gateway is the lease gateway: a reverse proxy in front of the
// target's API server for gateway leases (grants with access gateway).
//
// A client authenticates with its lease certificate (pki.SignLease), which
// the TLS handshake verifies against the signing CAs alone
// (pki.GatewayTLSConfig). Every request is then checked against the live
// lease Secret — the lease counter's memory, fed by a watch — and forwarded
// to the API server as the lease's ServiceAccount with a token the
// gateway holds (Tokens: one per lease and replica, short-lived, bound
// to the lease Secret, never sent to a client). The gateway keeps every connection of every
// lease; when the lease Secret goes (revoked through the API or the CLI,
// collected, expired, its namespace out of its grant) or its peer is on
// the deny list, it closes them all at once, open watches and exec,
// attach and port-forward streams included.
package gateway

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
)

// DenyList is the revocation deny list (enrollment.RevocationList).
type DenyList interface {
	Revoked(identity string, serials ...string) bool
}

// Defaults of Config.
const (
	// DefaultMaxConnsPerLease and DefaultMaxConnsPerPeer bound the open
	// connections of one lease and of all one peer's leases.
	DefaultMaxConnsPerLease = 64
	DefaultMaxConnsPerPeer  = 1024
	// DefaultMaxStreamsPerConn bounds the HTTP/2 streams of one
	// connection: client-go's informers of one process share one.
	DefaultMaxStreamsPerConn = 250
	// DefaultMaxRequestsPerLease and DefaultMaxRequestsPerPeer bound the
	// requests under way (watches and streams included) of one lease and
	// of all one peer's leases. Each open stream costs the broker up to
	// about 64 KiB (the upstream HTTP/2 window and the copy buffer) and
	// two goroutines; Argo CD's cluster cache opens a watch per API
	// resource, well under 256. A peer's whole allowance, about 64 MiB at
	// worst, fits in the chart's 256 Mi limit with room for everyone
	// else (docs/testing.md, the gateway's memory rows).
	DefaultMaxRequestsPerLease = 256
	DefaultMaxRequestsPerPeer  = 1024
	// DefaultMaxBodyBytes is the API server's own limit on a request body
	// (its MaxRequestBodyBytes, 3 MiB), so that the gateway refuses only
	// what the API server would.
	DefaultMaxBodyBytes = 3 << 20
	// newLeaseWait is how long a request waits for the counter to learn
	// of a lease whose certificate is younger than newLeaseAge: the
	// client can be faster than the watch, on another replica too.
	newLeaseWait = 2 * time.Second
	newLeaseAge  = 10 * time.Second
)

// Config is what a Gateway needs. Upstream, Tokens, Leases and Logger are
// required.
type Config struct {
	// Upstream is the API server's URL; Transport and UpgradeTransport
	// reach it (NewTransports), and carry no credential of their own.
	Upstream         *url.URL
	Transport        http.RoundTripper
	UpgradeTransport http.RoundTripper
	// Tokens gives the token a request of a lease is
	// forwarded with.
	Tokens func(ctx context.Context, lease pki.LeaseName) (string, error)
	Leases Leases
	// Deny, if set, refuses the leases of a revoked peer identity or a
	// revoked lease certificate serial, and ends their connections.
	Deny DenyList
	// Auditor receives one event per forwarded request and per revocation
	// that ended connections; nil writes none.
	Auditor audit.Auditor
	Metrics *Metrics
	Logger  *zap.Logger
	Clock   Clock
	// MaxConnsPerLease, MaxConnsPerPeer, MaxRequestsPerLease,
	// MaxRequestsPerPeer and MaxBodyBytes: zero means the defaults above.
	MaxConnsPerLease    int
	MaxConnsPerPeer     int
	MaxRequestsPerLease int
	MaxRequestsPerPeer  int
	MaxBodyBytes        int64
}

// Gateway serves gateway leases. Make one with New; serve ServeHTTP on a
// listener whose TLS profile is pki.GatewayTLSConfig and whose
// connections pass AdmitConn; feed it the counter's OnGone.
type Gateway struct {
	cfg   Config
	proxy *httputil.ReverseProxy

	mu     sync.Mutex
	leases map[string]*leaseConns // by leaseKey
	peers  map[string]int         // open connections by peer
	// gone are the leases the counter reported gone lately, by leaseKey,
	// until when they are remembered: a young lease's request is refused
	// at once, not after the wait for a lease the counter has not seen.
	gone map[string]time.Time
	// inflight and inflightPeers are the requests under way, by
	// leaseKey and by peer.
	inflight, inflightPeers map[string]int
	// rechecks are the answers of the API server while the counter is
	// blind (live.go).
	rechecks rechecks
	// admitted is what AdmitConn read from the certificate of each open
	// connection it admitted, by the connection's leaf (the pointer its
	// requests carry in Request.TLS), so that a request does not read it
	// again.
	admitted map[*x509.Certificate]*connLease
}

// connLease is what the requests of one connection share: its lease as
// its certificate names it, the lease's key, and the serials of its
// verified chains (as the deny list names them). None of it can change
// while the connection lives: TLS 1.3 has no renegotiation, and the
// gateway's listener asks for no post-handshake authentication. crypto/tls
// parses the certificate afresh for every handshake (session tickets are
// off: pki.GatewayTLSConfig), so a leaf pointer is one connection's; conns
// counts them all the same, should two connections ever share one.
type connLease struct {
	name    pki.LeaseName
	key     string
	serials []string
	conns   int // open connections with this leaf
}

// readConnLease reads st's lease from its verified leaf certificate.
func readConnLease(st *tls.ConnectionState) (*connLease, error) {
	n, err := leaseOf(st.PeerCertificates[0])
	if err != nil {
		return nil, err
	}
	return &connLease{name: n, key: leaseKey(n.Namespace, secretName(n), types.UID(n.UID)), serials: chainSerials(st)}, nil
}

// connLeaseOf is the lease of r's connection: AdmitConn's reading when it
// admitted the connection and the connection is still open, else read
// now (a connection refused at admission, or served without AdmitConn).
func (g *Gateway) connLeaseOf(st *tls.ConnectionState) (*connLease, error) {
	g.mu.Lock()
	cl := g.admitted[st.PeerCertificates[0]]
	g.mu.Unlock()
	if cl != nil {
		return cl, nil
	}
	return readConnLease(st)
}

// maxRecentlyGone bounds Gateway.gone; past it a young revoked lease's
// request waits newLeaseWait before its refusal, as without it.
const maxRecentlyGone = 100_000

// leaseConns are the open connections of one lease.
type leaseConns struct {
	name pki.LeaseName
	// serials are those of every certificate of the verified chains, as
	// the deny list names them: revoking the signing CA (or an
	// intermediate) ends the connections as revoking the leaf does.
	serials []string
	conns   map[io.Closer]struct{}
	timer   clock.Timer // closes them at the certificate's expiry
}

// New checks cfg and makes a Gateway.
func New(cfg Config) (*Gateway, error) {
	if cfg.Upstream == nil || cfg.Transport == nil || cfg.UpgradeTransport == nil || cfg.Tokens == nil || cfg.Leases == nil || cfg.Logger == nil {
		return nil, errors.New("gateway: Upstream, Transport, UpgradeTransport, Tokens, Leases and Logger are required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.MaxConnsPerLease == 0 {
		cfg.MaxConnsPerLease = DefaultMaxConnsPerLease
	}
	if cfg.MaxConnsPerPeer == 0 {
		cfg.MaxConnsPerPeer = DefaultMaxConnsPerPeer
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.MaxRequestsPerLease == 0 {
		cfg.MaxRequestsPerLease = DefaultMaxRequestsPerLease
	}
	if cfg.MaxRequestsPerPeer == 0 {
		cfg.MaxRequestsPerPeer = DefaultMaxRequestsPerPeer
	}
	g := &Gateway{cfg: cfg, leases: map[string]*leaseConns{}, peers: map[string]int{}, gone: map[string]time.Time{},
		inflight: map[string]int{}, inflightPeers: map[string]int{}, admitted: map[*x509.Certificate]*connLease{}}
	g.proxy = &httputil.ReverseProxy{
		Rewrite:   g.rewrite,
		Transport: upgradeSplit{plain: cfg.Transport, upgrade: cfg.UpgradeTransport},
		// A watch's answer (no Content-Length) is flushed after every
		// write, so each event goes out as it comes in; a whole answer
		// goes out in as few frames as it can.
		FlushInterval:  0,
		ErrorLog:       zap.NewStdLog(cfg.Logger.Named("proxy")),
		ErrorHandler:   g.proxyError,
		ModifyResponse: g.upgraded,
		BufferPool:     CopyBuffers(),
	}
	return g, nil
}

// CopyBuffers is the pool of buffers the gateway's proxy copies answers
// through: 32 KiB, httputil.ReverseProxy's own size, kept between requests
// instead of allocated and cleared for each. A stream (a watch, a followed
// log) holds its buffer while it runs, as it would its own.
// test/cmd/bareproxy copies through the same pool, so that the bench's
// baseline is the gateway's forwarding without its checks, not a slower
// proxy.
func CopyBuffers() httputil.BufferPool { return bufferPool{} }

const copyBufferSize = 32 << 10

var copyBufferPool = sync.Pool{New: func() any { return new([copyBufferSize]byte) }}

type bufferPool struct{}

func (bufferPool) Get() []byte { return copyBufferPool.Get().(*[copyBufferSize]byte)[:] }

// Put keeps buf if it is one of the pool's (a pointer to its array, so
// that keeping it allocates nothing).
func (bufferPool) Put(buf []byte) {
	if cap(buf) == copyBufferSize {
		copyBufferPool.Put((*[copyBufferSize]byte)(buf[:copyBufferSize]))
	}
}

// upgradeSplit sends upgrade requests (exec, attach, port-forward over
// SPDY or WebSocket) over HTTP/1.1, which alone can upgrade, and every
// other request over HTTP/2.
type upgradeSplit struct{ plain, upgrade http.RoundTripper }

func (u upgradeSplit) RoundTrip(r *http.Request) (*http.Response, error) {
	// exec, attach and port-forward upgrade a GET (WebSocket) or a POST
	// (SPDY); nothing else takes the upgrade path.
	if httpstream.IsUpgradeRequest(r) && (r.Method == http.MethodGet || r.Method == http.MethodPost) {
		return u.upgrade.RoundTrip(r)
	}
	return u.plain.RoundTrip(r)
}

// leaseKey names a lease Secret under its UID.
func leaseKey(namespace, name string, uid types.UID) string {
	return namespace + "/" + name + "/" + string(uid)
}

func secretName(n pki.LeaseName) string { return objects.LeaseSecretPrefix + n.ID }

// Connection refusal reasons (the listener's refused-connection metric).
const (
	RefusedPerLease = "per_lease"
	RefusedPerPeer  = "per_peer"
)

// refusedConnLinger is how long the connection of a lease known gone, or
// of a denied peer, is kept for its refusal's answer.
const refusedConnLinger = time.Second

// refusedAtAdmission says why a connection's lease gets no place: its peer
// or a certificate of its chain denied, or the lease known gone; "" if
// none.
func (g *Gateway) refusedAtAdmission(n pki.LeaseName, leaf *x509.Certificate, serials []string) string {
	switch {
	case g.denied(n.Peer, serials):
		return reasonDenied
	case g.goneAtAdmission(n, leaf):
		return reasonRevoked
	}
	return ""
}

// goneAtAdmission reports whether the lease of a connection's certificate
// is known to be gone: reported gone lately, or not held by a counter
// that can see its namespace although the certificate is too old to be
// on its way there. A blind counter's leases are left to the request's
// recheck.
func (g *Gateway) goneAtAdmission(n pki.LeaseName, leaf *x509.Certificate) bool {
	name, uid := secretName(n), types.UID(n.UID)
	if g.goneLately(leaseKey(n.Namespace, name, uid)) {
		return true
	}
	now := g.cfg.Clock.Now()
	if !now.Before(leaf.NotAfter) {
		return true
	}
	if _, ok := g.cfg.Leases.Holds(n.Namespace, name, uid, n.Peer, now); ok {
		return false
	}
	young := g.cfg.Clock.Since(leaf.NotBefore.Add(pki.Backdate)) <= newLeaseAge
	return !young && g.cfg.Leases.Synced() && !g.cfg.Leases.Blind(n.Namespace, now)
}

// denied reports whether peer, or any of serials (those of a
// connection's verified chains, chainSerials), is on the deny list.
func (g *Gateway) denied(peer string, serials []string) bool {
	if g.cfg.Deny == nil {
		return false
	}
	return g.cfg.Deny.Revoked(peer, serials...)
}

// chainSerials are the serials of every certificate of st's verified
// chains (the leaf's first), each once.
func chainSerials(st *tls.ConnectionState) []string {
	var out []string
	for _, chain := range st.VerifiedChains {
		for _, c := range chain {
			if s := serialOf(c); !slices.Contains(out, s) {
				out = append(out, s)
			}
		}
	}
	if len(out) == 0 && len(st.PeerCertificates) > 0 {
		out = append(out, serialOf(st.PeerCertificates[0]))
	}
	return out
}

// Over-cap reasons of acquire.
const (
	overPerLease = "per_lease"
	overPerPeer  = "per_peer"
)

// acquire takes a place for one request of the lease key and its peer
// under their caps, or says which cap is full.
func (g *Gateway) acquire(key, peer string) (release func(), over string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.inflight[key] >= g.cfg.MaxRequestsPerLease {
		return nil, overPerLease
	}
	if g.inflightPeers[peer] >= g.cfg.MaxRequestsPerPeer {
		return nil, overPerPeer
	}
	g.inflight[key]++
	g.inflightPeers[peer]++
	g.cfg.Metrics.inflight(1)
	return func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.inflight[key]--; g.inflight[key] <= 0 {
			delete(g.inflight, key)
		}
		if g.inflightPeers[peer]--; g.inflightPeers[peer] <= 0 {
			delete(g.inflightPeers, peer)
		}
		g.cfg.Metrics.inflight(-1)
	}, ""
}

// InFlight is the number of requests under way of the lease
// namespace/name under uid, for tests and the bench.
func (g *Gateway) InFlight(namespace, name string, uid types.UID) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.inflight[leaseKey(namespace, name, uid)]
}

// upgraded audits the API server's 101 to an upgrade (ModifyResponse):
// exec, attach and port-forward are on the record from their start.
func (g *Gateway) upgraded(resp *http.Response) error {
	if resp.StatusCode != http.StatusSwitchingProtocols {
		return nil
	}
	f, ok := resp.Request.Context().Value(ctxKey{}).(*forwarded)
	if !ok {
		return nil
	}
	f.upgraded = true
	ev := f.ev
	ev.Action, ev.Status = audit.ActionGatewayUpgrade, http.StatusSwitchingProtocols
	g.audit(ev)
	return nil
}

// AdmitConn takes an open connection's place under its lease's and peer's
// caps and keeps it, so that the lease's revocation closes it. c is the
// connection's socket (closing it ends the connection at once, with no
// TLS close to wait for). It returns the function that gives the place
// back when the connection closes, or the reason it is refused.
func (g *Gateway) AdmitConn(st tls.ConnectionState, c io.Closer) (release func(), reason, who string) {
	if len(st.PeerCertificates) == 0 {
		return nil, "no_certificate", ""
	}
	leaf := st.PeerCertificates[0]
	cl, err := readConnLease(&st)
	if err != nil {
		return nil, "not_a_lease", ""
	}
	n, key := cl.name, cl.key
	// A revoked lease or a denied peer takes no place under the caps: its
	// connection lives only for its first request's refusal (401 or 403,
	// which kubectl shows, where a closed connection shows as EOF), and
	// at most refusedConnLinger.
	if reason := g.refusedAtAdmission(n, leaf, cl.serials); reason != "" {
		t := g.cfg.Clock.AfterFunc(refusedConnLinger, func() { _ = c.Close() })
		g.cfg.Metrics.ended(reason, 1)
		return func() { t.Stop() }, "", ""
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	lc := g.leases[key]
	if lc != nil && len(lc.conns) >= g.cfg.MaxConnsPerLease {
		return nil, RefusedPerLease, n.ID
	}
	if g.peers[n.Peer] >= g.cfg.MaxConnsPerPeer {
		return nil, RefusedPerPeer, n.Peer
	}
	if lc == nil {
		lc = &leaseConns{name: n, serials: cl.serials, conns: map[io.Closer]struct{}{}}
		g.leases[key] = lc
		// The certificate is no good past its NotAfter; neither are the
		// connections it opened.
		lc.timer = g.cfg.Clock.AfterFunc(leaf.NotAfter.Sub(g.cfg.Clock.Now()), func() { go g.end(key, reasonExpired) })
	}
	lc.conns[c] = struct{}{}
	if known := g.admitted[leaf]; known != nil {
		known.conns++
	} else {
		cl.conns = 1
		g.admitted[leaf] = cl
	}
	g.peers[n.Peer]++
	g.cfg.Metrics.connOpened(n.Peer)
	return func() { g.release(key, n.Peer, c, leaf) }, "", ""
}

func (g *Gateway) release(key, peer string, c io.Closer, leaf *x509.Certificate) {
	g.mu.Lock()
	defer g.mu.Unlock()
	lc := g.leases[key]
	if lc == nil {
		return
	}
	if _, ok := lc.conns[c]; !ok {
		return
	}
	delete(lc.conns, c)
	if cl := g.admitted[leaf]; cl != nil {
		if cl.conns--; cl.conns <= 0 {
			delete(g.admitted, leaf)
		}
	}
	g.cfg.Metrics.connClosed(peer)
	if g.peers[peer]--; g.peers[peer] <= 0 {
		delete(g.peers, peer)
	}
	if len(lc.conns) == 0 {
		lc.timer.Stop()
		delete(g.leases, key)
	}
}

// Reasons a lease's connections are ended.
const (
	reasonRevoked = "revoked"
	reasonExpired = "expired"
	reasonDenied  = "denied"
)

// Gone ends every connection of the lease Secret namespace/name under
// uid: the counter calls it (lease.Counter.OnGone) as the Secret goes. It
// does not block: the sockets are closed in the background.
func (g *Gateway) Gone(namespace, name string, uid types.UID) {
	key := leaseKey(namespace, name, uid)
	g.remember(key)
	g.end(key, reasonRevoked)
}

// end closes the connections of the lease key; the releases of their
// close remove the lease.
func (g *Gateway) end(key, reason string) {
	g.mu.Lock()
	lc := g.leases[key]
	if lc == nil {
		g.mu.Unlock()
		return
	}
	conns := make([]io.Closer, 0, len(lc.conns))
	for c := range lc.conns {
		conns = append(conns, c)
	}
	n := lc.name
	g.mu.Unlock()
	// The counter calls Gone under its lock: the sockets are closed, and
	// the close audited, beside it.
	go func() {
		for _, c := range conns {
			_ = c.Close()
		}
		g.cfg.Metrics.ended(reason, len(conns))
		g.audit(audit.Event{Action: audit.ActionGatewayClose, Decision: audit.DecisionDeny, Reason: reason,
			Identity: n.Peer, Namespace: n.Namespace, ServiceAccount: n.ServiceAccount, LeaseID: n.ID, Connections: len(conns)})
		g.cfg.Logger.Info("lease gateway: connections ended", zap.String("lease_id", n.ID), zap.String("reason", reason), zap.Int("connections", len(conns)))
	}()
}

// serialOf is a certificate's serial as the deny list writes it
// (enrollment.NormalizeSerial: lower-case hexadecimal, no leading zero).
func serialOf(c *x509.Certificate) string { return c.SerialNumber.Text(16) }

// SweepDenied ends the connections of every lease whose peer identity or
// certificate serial is on the deny list now. RunDenySweeps calls it.
func (g *Gateway) SweepDenied() {
	if g.cfg.Deny == nil {
		return
	}
	g.mu.Lock()
	var denied []string
	for key, lc := range g.leases {
		if g.cfg.Deny.Revoked(lc.name.Peer, lc.serials...) {
			denied = append(denied, key)
		}
	}
	g.mu.Unlock()
	for _, key := range denied {
		g.end(key, reasonDenied)
	}
}

// DenySweepInterval is how often RunDenySweeps looks at the deny list:
// an entry added ends the open connections it covers within it, and its
// new requests at once.
const DenySweepInterval = time.Second

// RunDenySweeps calls SweepDenied every DenySweepInterval until ctx ends.
func (g *Gateway) RunDenySweeps(ctx context.Context) {
	t := g.cfg.Clock.NewTicker(DenySweepInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			g.SweepDenied()
		}
	}
}

// CloseAll ends every connection (the process is shutting down: clients
// reconnect to another replica).
func (g *Gateway) CloseAll() {
	g.mu.Lock()
	keys := make([]string, 0, len(g.leases))
	for k := range g.leases {
		keys = append(keys, k)
	}
	g.mu.Unlock()
	for _, k := range keys {
		g.mu.Lock()
		lc := g.leases[k]
		var conns []io.Closer
		if lc != nil {
			for c := range lc.conns {
				conns = append(conns, c)
			}
		}
		g.mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	}
}

// OpenConns is the number of open connections of the lease namespace/name
// under uid, for tests and the bench.
func (g *Gateway) OpenConns(namespace, name string, uid types.UID) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if lc := g.leases[leaseKey(namespace, name, uid)]; lc != nil {
		return len(lc.conns)
	}
	return 0
}

// leaseOf reads the lease of a certificate the handshake verified
// (pki.GatewayTLSConfig): its URN and peer.
func leaseOf(leaf *x509.Certificate) (pki.LeaseName, error) {
	if len(leaf.URIs) != 1 || len(leaf.Subject.Organization) != 1 {
		return pki.LeaseName{}, pki.ErrInvalidLeaseCertificate
	}
	n, err := pki.ParseLeaseURN(leaf.URIs[0].String())
	if err != nil {
		return pki.LeaseName{}, err
	}
	n.Peer = leaf.Subject.Organization[0]
	return n, nil
}

// ctxKey carries a request's lease and audit id to rewrite.
type ctxKey struct{}

type forwarded struct {
	lease   pki.LeaseName
	token   string
	auditID string
	// ev is the request's audit event as forwarded (the upgrade event
	// copies it); upgraded is set at the API server's 101.
	ev       audit.Event
	upgraded bool
	body     *bodyReader
}

// ServeHTTP checks the request's lease and forwards it.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := g.cfg.Clock.Now()
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		writeStatus(w, http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease gateway needs a lease certificate")
		return
	}
	leaf := r.TLS.PeerCertificates[0]
	cl, err := g.connLeaseOf(r.TLS)
	if err != nil {
		writeStatus(w, http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease gateway needs a lease certificate")
		return
	}
	n := cl.name
	// The path as it is forwarded (rewrite keeps the raw path), so that
	// the audit names what the API server was asked.
	ev := audit.Event{Action: audit.ActionGatewayRequest, Identity: n.Peer, Namespace: n.Namespace,
		ServiceAccount: n.ServiceAccount, LeaseID: n.ID, Access: "gateway", Method: r.Method, Path: r.URL.EscapedPath(),
		RequestID: audit.RequestID(r.Context())}
	// answer answers without forwarding, and audits it.
	answer := func(decision string, code int, reason metav1.StatusReason, msg, why string) {
		writeStatus(w, code, reason, msg)
		ev.Decision, ev.Status, ev.Reason = decision, code, why
		g.done(ev, start)
	}
	refuse := func(code int, reason metav1.StatusReason, msg, why string) {
		w.Header().Set("Connection", "close")
		answer(audit.DecisionDeny, code, reason, msg, why)
	}
	// HTTP/1.1 framing by Transfer-Encoding: Go's server reads the body
	// by it and drops a Content-Length beside it, so that a request
	// carrying both (a smuggling attempt: RFC 9112, section 6.1) could
	// not be told from one carrying Transfer-Encoding alone. Kubernetes'
	// clients send a Content-Length or speak HTTP/2, so both are refused,
	// and the connection closed.
	if r.ProtoMajor == 1 && len(r.TransferEncoding) > 0 {
		refuse(http.StatusBadRequest, metav1.StatusReasonBadRequest, "the lease gateway takes HTTP/1.1 request bodies with a Content-Length only (or over HTTP/2)", "transfer_encoding")
		return
	}
	// A body on a request that takes none (or that upgrades) is refused:
	// the API server may answer a GET without reading it, and an unread
	// body holds the connection's receive buffer in the broker.
	if (r.ContentLength != 0 || len(r.TransferEncoding) > 0) && (r.Method == http.MethodGet || r.Method == http.MethodHead || httpstream.IsUpgradeRequest(r)) {
		refuse(http.StatusBadRequest, metav1.StatusReasonBadRequest, "the lease gateway takes no request body on GET, HEAD or an upgrade", "body_not_allowed")
		return
	}
	// The request's place under the caps is taken first, so that the
	// waits below (a young lease, a blind replica's recheck) are bounded
	// by it too.
	key := cl.key
	release, over := g.acquire(key, n.Peer)
	if over != "" {
		// As the API server answers its own overload: the client backs
		// off and retries (client-go does), and the connection stays.
		w.Header().Set("Retry-After", "1")
		answer(audit.DecisionDeny, http.StatusTooManyRequests, metav1.StatusReasonTooManyRequests,
			fmt.Sprintf("too many requests of this %s under way at the lease gateway; retry", strings.TrimPrefix(over, "per_")), "too_many_requests_"+over)
		return
	}
	defer release()
	// A refused request's connection closes after its answer (Connection:
	// close; GOAWAY in HTTP/2); the lease's other connections were ended
	// when it went (Gone, SweepDenied).
	if g.denied(n.Peer, cl.serials) {
		refuse(http.StatusForbidden, metav1.StatusReasonForbidden, "this lease's peer or certificate is revoked", "revoked")
		return
	}
	switch g.live(r.Context(), n, leaf.NotBefore) {
	case leaseGone:
		refuse(http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease is revoked or expired", "lease_gone")
		return
	case leaseUnconfirmed:
		// Blind to the leases and the API server did not answer: another
		// replica may see them.
		w.Header().Set("Retry-After", "1")
		refuse(http.StatusServiceUnavailable, metav1.StatusReasonServiceUnavailable, "the lease gateway cannot confirm this lease with the API server now; retry", "lease_unconfirmed")
		return
	}
	token, err := g.cfg.Tokens(r.Context(), n)
	if err != nil {
		g.cfg.Logger.Warn("lease gateway: no token to forward with", zap.String("lease_id", n.ID), zap.Error(err))
		w.Header().Set("Retry-After", "1")
		answer(audit.DecisionError, http.StatusServiceUnavailable, metav1.StatusReasonServiceUnavailable,
			"the lease gateway cannot reach the API server as this lease's ServiceAccount now; retry", "no_upstream_token")
		return
	}
	f := &forwarded{lease: n, token: token}
	if r.Body != nil && r.Body != http.NoBody {
		// Upgrades included: Kubernetes' carry no body, and a request
		// that only claims to upgrade gets no larger one.
		f.body = &bodyReader{rc: http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)}
		r.Body = f.body
	}
	ev.APIAuditID = newAuditID()
	ev.Decision = audit.DecisionAllow
	f.auditID, f.ev = ev.APIAuditID, ev
	if longRunning(r) {
		// On the record while it runs, and if the replica dies before it
		// ends.
		fwd := ev
		fwd.Action = audit.ActionGatewayForward
		g.audit(fwd)
	}
	sw := &statusWriter{ResponseWriter: w}
	// However the request ends — its answer complete, the client gone, the
	// lease revoked, the API server's stream broken — it is audited and
	// measured. ReverseProxy panics with http.ErrAbortHandler when copying
	// a streamed answer fails, which is how every watch ends when its
	// client (or a revocation) closes it.
	defer func() {
		p := recover()
		ev.Status = sw.status(f.upgraded)
		switch {
		case p != nil && p != http.ErrAbortHandler:
			ev.Decision, ev.Reason = audit.DecisionError, "panic"
		case p != nil || r.Context().Err() != nil || ev.Status == statusClientGone:
			ev.Reason = g.endedBy(cl, leaf, r)
		case ev.Status == http.StatusBadGateway:
			ev.Reason = "upstream_error"
		}
		g.done(ev, start)
		if p != nil {
			panic(p)
		}
	}()
	g.proxy.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), ctxKey{}, f)))
}

// statusClientGone is the status of a request whose client went before
// its answer (nginx's 499): recorded, never sent.
const statusClientGone = 499

// endedBy says why a forwarded request ended early: its lease revoked or
// expired, its peer denied, or its client gone (or a failed upstream
// stream, when the client is still there).
func (g *Gateway) endedBy(cl *connLease, leaf *x509.Certificate, r *http.Request) string {
	switch {
	case g.goneLately(cl.key):
		return reasonRevoked
	case g.denied(cl.name.Peer, cl.serials):
		return reasonDenied
	case !g.cfg.Clock.Now().Before(leaf.NotAfter):
		return reasonExpired
	case r.Context().Err() != nil:
		return "client_gone"
	default:
		return "upstream_error"
	}
}

// longRunning reports whether r is a request whose answer is a stream
// (the API server's long-running requests: watches, exec, attach,
// port-forward, proxy, followed logs), audited when it is forwarded as
// well as when it ends.
func longRunning(r *http.Request) bool {
	if httpstream.IsUpgradeRequest(r) {
		return true
	}
	q := r.URL.Query()
	if queryTrue(q, "watch") || strings.Contains(r.URL.Path, "/watch/") {
		return true
	}
	if queryTrue(q, "follow") && strings.HasSuffix(r.URL.Path, "/log") {
		return true
	}
	return strings.HasSuffix(r.URL.Path, "/proxy") || strings.Contains(r.URL.Path, "/proxy/")
}

// queryTrue reads a boolean query parameter as the API server does
// (apimachinery's Convert_Slice_string_To_bool): present, and neither
// "0" nor "false" in any case, is true.
func queryTrue(q url.Values, name string) bool {
	v, ok := q[name]
	if !ok || len(v) == 0 {
		return false
	}
	s := strings.ToLower(v[0])
	return s != "0" && s != "false"
}

// bodyReader keeps the error a request body's read failed with, so that
// a body the client broke off or framed wrong is answered 400 (or 413),
// not as an upstream failure.
type bodyReader struct {
	rc  io.ReadCloser
	err error
}

func (b *bodyReader) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil && err != io.EOF && b.err == nil {
		b.err = err
	}
	return n, err
}

func (b *bodyReader) Close() error { return b.rc.Close() }

func (g *Gateway) done(ev audit.Event, start time.Time) {
	d := g.cfg.Clock.Since(start)
	ev.DurationMS = d.Milliseconds()
	g.cfg.Metrics.request(ev.Identity, ev.Status, d)
	g.audit(ev)
}

func (g *Gateway) audit(ev audit.Event) {
	if g.cfg.Auditor == nil {
		return
	}
	ev.Time = g.cfg.Clock.Now().UTC()
	ev.Audit = audit.Schema
	ev.Access = "gateway"
	if err := g.cfg.Auditor.Audit(ev); err != nil {
		g.cfg.Logger.Error("write audit event", zap.Error(err))
	}
}

// Headers a client may not send upstream: the gateway sets the
// credential and the audit id itself, and the front-proxy headers are
// stripped, whatever the API server's configuration.
var strippedHeaders = []string{"Authorization", "Audit-Id", "Proxy-Authorization", "Cookie"}

// UserAgentSuffix is appended to the user agent of every forwarded
// request, with the lease id, so that the API server's audit log names
// the lease ("tokenbroker audit" reads it).
const UserAgentSuffix = " tokenbroker-lease/"

func (g *Gateway) rewrite(pr *httputil.ProxyRequest) {
	f := pr.In.Context().Value(ctxKey{}).(*forwarded)
	pr.SetURL(g.cfg.Upstream)
	// SetURL joins the paths; the API server's URL has none of its own.
	pr.Out.URL.Path, pr.Out.URL.RawPath = pr.In.URL.Path, pr.In.URL.RawPath
	pr.Out.Host = g.cfg.Upstream.Host
	for _, h := range strippedHeaders {
		pr.Out.Header.Del(h)
	}
	for k := range pr.Out.Header {
		// The front-proxy headers, whatever the API server's
		// configuration names (X-Remote-User, -Group, -Uid, -Extra-*).
		if strings.HasPrefix(strings.ToLower(k), "x-remote-") {
			pr.Out.Header.Del(k)
		}
	}
	pr.Out.Header.Set("Authorization", "Bearer "+f.token)
	pr.Out.Header.Set("Audit-Id", f.auditID)
	pr.Out.Header.Set("User-Agent", pr.In.Header.Get("User-Agent")+UserAgentSuffix+f.lease.ID)
	// No X-Forwarded-For: the API server need not know the client's
	// address, and the broker's audit has it.
	pr.Out.Header.Del("X-Forwarded-For")
}

func (g *Gateway) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	var mbe *http.MaxBytesError
	var bodyErr error
	if f, ok := r.Context().Value(ctxKey{}).(*forwarded); ok && f.body != nil {
		bodyErr = f.body.err
	}
	switch {
	case errors.As(err, &mbe) || errors.As(bodyErr, &mbe):
		writeStatus(w, http.StatusRequestEntityTooLarge, metav1.StatusReasonRequestEntityTooLarge,
			fmt.Sprintf("the request body is over the limit of %d bytes", mbe.Limit))
	case bodyErr != nil:
		// The client's body broke off or was framed wrong: its error,
		// not the API server's (a client that half-closed may still read
		// the answer).
		writeStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, "the request body could not be read")
	case r.Context().Err() != nil:
		// The client went away (or the lease's connection was closed).
		w.WriteHeader(statusClientGone)
	default:
		g.cfg.Logger.Warn("lease gateway: forward failed", zap.Error(err))
		writeStatus(w, http.StatusBadGateway, metav1.StatusReasonServiceUnavailable, "the lease gateway could not reach the API server")
	}
}

// writeStatus answers as the API server would, with a metav1.Status, so
// that kubectl and client-go show the message.
func writeStatus(w http.ResponseWriter, code int, reason metav1.StatusReason, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":%s,"reason":%q,"code":%d}`+"\n",
		strconv.Quote(msg), reason, code)
}

// newAuditID is a random UUID (version 4), the form the API server gives
// its own audit ids.
func newAuditID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var id [36]byte
	hex.Encode(id[0:8], b[0:4])
	id[8] = '-'
	hex.Encode(id[9:13], b[4:6])
	id[13] = '-'
	hex.Encode(id[14:18], b[6:8])
	id[18] = '-'
	hex.Encode(id[19:23], b[8:10])
	id[23] = '-'
	hex.Encode(id[24:36], b[10:16])
	return string(id[:])
}

// statusWriter remembers the status a response was written with. It
// passes Flush and Hijack through (http.ResponseController unwraps it).
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// status is the status the client was answered with: upgraded, the
// API server's 101 (the connection was hijacked, nothing written here);
// nothing written otherwise, the client went first.
func (s *statusWriter) status(upgraded bool) int {
	switch {
	case s.code != 0:
		return s.code
	case upgraded:
		return http.StatusSwitchingProtocols
	default:
		return statusClientGone
	}
}

// Clock is what the gateway needs of a clock: timers for expiries and
// waits, a ticker for the deny-list sweep (k8s.io/utils/clock.RealClock
// and its fake).
type Clock interface {
	clock.WithDelayedExecution
	clock.WithTicker
}
