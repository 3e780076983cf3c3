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
	// Tokens gives the token a request of namespace/serviceAccount is
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
	// MaxConnsPerLease, MaxConnsPerPeer and MaxBodyBytes: zero means the
	// defaults above.
	MaxConnsPerLease int
	MaxConnsPerPeer  int
	MaxBodyBytes     int64
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
}

// maxRecentlyGone bounds Gateway.gone; past it a young revoked lease's
// request waits newLeaseWait before its refusal, as without it.
const maxRecentlyGone = 100_000

// leaseConns are the open connections of one lease.
type leaseConns struct {
	name   pki.LeaseName
	serial string // the certificate's, as the deny list names it
	conns  map[io.Closer]struct{}
	timer  clock.Timer // closes them at the certificate's expiry
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
	g := &Gateway{cfg: cfg, leases: map[string]*leaseConns{}, peers: map[string]int{}, gone: map[string]time.Time{}}
	g.proxy = &httputil.ReverseProxy{
		Rewrite:   g.rewrite,
		Transport: upgradeSplit{plain: cfg.Transport, upgrade: cfg.UpgradeTransport},
		// A watch's answer (no Content-Length) is flushed after every
		// write, so each event goes out as it comes in; a whole answer
		// goes out in as few frames as it can.
		FlushInterval: 0,
		ErrorLog:      zap.NewStdLog(cfg.Logger.Named("proxy")),
		ErrorHandler:  g.proxyError,
	}
	return g, nil
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
	n, err := leaseOf(leaf)
	if err != nil {
		return nil, "not_a_lease", ""
	}
	key := leaseKey(n.Namespace, secretName(n), types.UID(n.UID))
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
		lc = &leaseConns{name: n, serial: serialOf(leaf), conns: map[io.Closer]struct{}{}}
		g.leases[key] = lc
		// The certificate is no good past its NotAfter; neither are the
		// connections it opened.
		lc.timer = g.cfg.Clock.AfterFunc(leaf.NotAfter.Sub(g.cfg.Clock.Now()), func() { go g.end(key, reasonExpired) })
	}
	lc.conns[c] = struct{}{}
	g.peers[n.Peer]++
	g.cfg.Metrics.connOpened(n.Peer)
	return func() { g.release(key, n.Peer, c) }, "", ""
}

func (g *Gateway) release(key, peer string, c io.Closer) {
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
		if g.cfg.Deny.Revoked(lc.name.Peer, lc.serial) {
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
}

// ServeHTTP checks the request's lease and forwards it.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := g.cfg.Clock.Now()
	if r.TLS == nil || len(r.TLS.PeerCertificates) == 0 {
		writeStatus(w, http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease gateway needs a lease certificate")
		return
	}
	leaf := r.TLS.PeerCertificates[0]
	n, err := leaseOf(leaf)
	if err != nil {
		writeStatus(w, http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease gateway needs a lease certificate")
		return
	}
	ev := audit.Event{Action: audit.ActionGatewayRequest, Identity: n.Peer, Namespace: n.Namespace,
		ServiceAccount: n.ServiceAccount, LeaseID: n.ID, Access: "gateway", Method: r.Method, Path: r.URL.Path,
		RequestID: audit.RequestID(r.Context())}
	refuse := func(code int, reason metav1.StatusReason, msg, why string) {
		w.Header().Set("Connection", "close")
		writeStatus(w, code, reason, msg)
		ev.Decision, ev.Status, ev.Reason = audit.DecisionDeny, code, why
		g.done(ev, start)
	}
	// A refused request's connection closes after its answer (Connection:
	// close; GOAWAY in HTTP/2); the lease's other connections were ended
	// when it went (Gone, SweepDenied).
	if g.cfg.Deny != nil && g.cfg.Deny.Revoked(n.Peer, serialOf(leaf)) {
		refuse(http.StatusForbidden, metav1.StatusReasonForbidden, "this lease's peer or certificate is revoked", "revoked")
		return
	}
	if !g.live(r.Context(), n, leaf.NotBefore) {
		refuse(http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "the lease is revoked or expired", "lease_gone")
		return
	}
	token, err := g.cfg.Tokens(r.Context(), n)
	if err != nil {
		g.cfg.Logger.Warn("lease gateway: no token to forward with", zap.String("lease_id", n.ID), zap.Error(err))
		w.Header().Set("Retry-After", "1")
		writeStatus(w, http.StatusServiceUnavailable, metav1.StatusReasonServiceUnavailable, "the lease gateway cannot reach the API server as this lease's ServiceAccount now; retry")
		ev.Decision, ev.Status, ev.Reason = audit.DecisionError, http.StatusServiceUnavailable, "no_upstream_token"
		g.done(ev, start)
		return
	}
	if r.Body != nil && r.Body != http.NoBody {
		// Upgrades included: Kubernetes' carry no body, and a request
		// that only claims to upgrade gets no larger one.
		r.Body = http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)
	}
	ev.APIAuditID = newAuditID()
	sw := &statusWriter{ResponseWriter: w}
	g.proxy.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), ctxKey{}, &forwarded{lease: n, token: token, auditID: ev.APIAuditID})))
	ev.Decision, ev.Status = audit.DecisionAllow, sw.status()
	g.done(ev, start)
}

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
var strippedHeaders = []string{"Authorization", "Audit-Id", "X-Remote-User", "X-Remote-Group", "Proxy-Authorization", "Cookie"}

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
		if strings.HasPrefix(strings.ToLower(k), "x-remote-extra-") {
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
	switch {
	case errors.As(err, &mbe):
		writeStatus(w, http.StatusRequestEntityTooLarge, metav1.StatusReasonRequestEntityTooLarge,
			fmt.Sprintf("the request body is over the limit of %d bytes", mbe.Limit))
	case r.Context().Err() != nil:
		// The client went away (or the lease's connection was closed).
		w.WriteHeader(499)
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
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
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

func (s *statusWriter) status() int {
	if s.code == 0 {
		return http.StatusSwitchingProtocols // hijacked: an upgrade
	}
	return s.code
}

// Clock is what the gateway needs of a clock: timers for expiries and
// waits, a ticker for the deny-list sweep (k8s.io/utils/clock.RealClock
// and its fake).
type Clock interface {
	clock.WithDelayedExecution
	clock.WithTicker
}
