package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Broker is what the HTTP layer needs from the domain core. Errors are
// *broker.Error (their Kind chooses the status; KindUnavailable is the
// retryable one, answered 503 with Retry-After) or unclassified (500).
// Contexts are request contexts: they end when the client goes away or the
// shutdown grace period is over.
type Broker interface {
	// IssueKubeconfig mints a credential for the caller and wraps it in a
	// kubeconfig. req has passed validateKubeconfigRequest (well-formed
	// names, durations in (0, 8760h], bounded audiences, known credential
	// kind); authorization and TTL clamping are the broker's. A cancelled
	// ctx must not leave a partial lease behind.
	IssueKubeconfig(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error)
	// ExecKubeconfig authorizes req as IssueKubeconfig does and returns a
	// kubeconfig whose user runs the exec credential plugin against
	// brokerURL (https://host[:port], checked); it issues nothing.
	ExecKubeconfig(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error)
	// ListLeases returns one page of the caller's own leases and the
	// continue token of the next; an invalid limit or continue token is
	// KindInvalid.
	ListLeases(ctx context.Context, c broker.Caller, req lease.PageRequest) (*apiv1.LeaseList, error)
	// GetLease returns one of the caller's leases. id has passed
	// apiv1.ValidLeaseID; a lease that does not exist and one that is not
	// the caller's must both be KindNotFound with the same detail.
	GetLease(ctx context.Context, c broker.Caller, id string) (*apiv1.Lease, error)
	// RevokeLease revokes one of the caller's leases; id as for GetLease.
	RevokeLease(ctx context.Context, c broker.Caller, id string) error
	// WhoAmI returns the policy name of the caller and the grants that
	// apply to it.
	WhoAmI(c broker.Caller) (peer string, grants []apiv1.Grant)
	// Ready reports whether the API server is reachable and a policy is
	// loaded; a non-nil error makes /readyz answer 503.
	Ready(ctx context.Context) error
}

// LimitsReporter is the optional ability of a Broker to tell a caller its
// limits and usage, shown by GET /v1/whoami.
type LimitsReporter interface {
	// Limits returns the caller's limits and usage; nil for an identity
	// the policy does not know.
	Limits(c broker.Caller) *apiv1.PeerLimits
}

// CertificateIssuer is the optional ability of a Broker to issue client
// certificates and serve the trust bundle; the server finds it by type
// assertion. Without it POST /v1/certificates and GET /v1/trust-bundle
// answer 404. Errors are as for Broker.
type CertificateIssuer interface {
	// Enroll issues a first certificate to the bearer of a join token.
	// token is the bearer token as sent (at most pki.MaxJoinTokenBytes);
	// req has passed validateCertificateRequest. Every problem with the
	// token must be KindUnauthenticated with the same detail.
	Enroll(ctx context.Context, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)
	// Renew issues a new certificate to an authenticated caller for its
	// own identity.
	Renew(ctx context.Context, c broker.Caller, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)
	// TrustBundle returns the CA bundle in force; an empty CABundle means
	// there is none to serve (404).
	TrustBundle() apiv1.TrustBundle
}

// RevocationChecker is the optional ability of a Broker to tell revoked
// callers; the server finds it by type assertion and asks it on every API
// request, so that a revocation also ends keep-alive connections.
type RevocationChecker interface {
	// Revoked reports whether the identity or any of the serials (the
	// lower-case hexadecimal serial numbers of the certificates of every
	// verified chain, the leaf first, each once) is revoked.
	Revoked(identity string, serials ...string) bool
	// RevokedPod reports whether the Pod of this uid, as a pod certificate
	// names it, is revoked.
	RevokedPod(uid string) bool
}

// RefusalAuditor is implemented by a Broker that records refused callers in
// its audit trail (*broker.Broker does): the authentication middleware
// calls RefuseCaller for every request it answers 401 on the mutual-TLS
// listener, with what it knows of the caller (either may be empty), a
// reason code (see the Refused* constants of the broker package) and the
// reason.
type RefusalAuditor interface {
	RefuseCaller(ctx context.Context, c broker.Caller, code, reason string)
}

// BackgroundWriter is the optional ability of a Broker to finish, at
// shutdown, the writes it started after answering (the credential-id
// annotation of lease Secrets, the claim of a gateway lease signed for a
// pooled Secret); the server finds it by type assertion and
// waits for them within its shutdown grace.
type BackgroundWriter interface {
	WaitWritesAfterAnswers(ctx context.Context) error
}

// WorkloadAuthenticator is the optional ability of a Broker to verify the
// workload tokens peers send beside their certificate and to keep the key
// sets they upload; the server finds it by type assertion. Without it a
// request with a workload token gets 401 (reason no-trust) and PUT
// /v1/peers/self/jwks 404.
type WorkloadAuthenticator interface {
	// AuthenticateWorkload verifies token (at most
	// pki.MaxWorkloadTokenBytes of b64token characters) for the caller and
	// returns the caller with its Workload. Refusals are
	// broker.KindBadWorkloadToken with a Reason.
	AuthenticateWorkload(ctx context.Context, c broker.Caller, token string) (broker.Caller, error)
	// PutPeerJWKS stores the caller's cluster's key set, doc being the
	// body as sent (at most pki.MaxJWKSBytes).
	PutPeerJWKS(ctx context.Context, c broker.Caller, doc []byte) (*apiv1.PeerJWKS, error)
	// ReportPeerPods stores the uids of the Pods that live in the caller's
	// cluster (decoded, not yet validated).
	ReportPeerPods(ctx context.Context, c broker.Caller, uids []string) (*apiv1.PeerLivePods, error)
	// AuthenticatePodCertificate decides whether the workload w of the
	// caller's verified pod certificate may ask here and returns the
	// caller with its Workload, or, for the peer's agent, as the peer
	// itself with Agent set. Refusals are problem.KindBadPodCertificate
	// with a Reason.
	AuthenticatePodCertificate(ctx context.Context, c broker.Caller, w *pki.PodWorkload) (broker.Caller, error)
}

// TrustAnchors is the client-CA bundle in force (*pki.PoolReloader, which
// follows its file). See Config.ClientCAs.
type TrustAnchors interface {
	Certificates() []*x509.Certificate
}

// The broker package's core is what the composition root passes as Broker,
// and it has the optional abilities.
var (
	_ Broker                = (*broker.Broker)(nil)
	_ CertificateIssuer     = (*broker.Broker)(nil)
	_ RevocationChecker     = (*broker.Broker)(nil)
	_ RefusalAuditor        = (*broker.Broker)(nil)
	_ WorkloadAuthenticator = (*broker.Broker)(nil)
	_ BackgroundWriter      = (*broker.Broker)(nil)
	_ TrustAnchors          = (*pki.PoolReloader)(nil)
)

// Defaults applied by New to zero fields of Config.
const (
	// DefaultMaxBodyBytes bounds a request body; API bodies are small.
	DefaultMaxBodyBytes = 64 << 10
	// DefaultMaxHeaderBytes bounds the request line and headers; the
	// client certificate travels in TLS, not in a header.
	DefaultMaxHeaderBytes = 16 << 10
	// DefaultReadHeaderTimeout stops slow-header (slowloris) clients.
	DefaultReadHeaderTimeout = 5 * time.Second
	// DefaultHandshakeTimeout bounds a TLS handshake. It is shorter than
	// the header timeout because a handshake is what a client without a
	// certificate can stall, and a stalled handshake holds a slot of
	// MaxHandshakes and its memory until it ends. A TLS 1.3 handshake with
	// a client certificate takes two round trips: 3s leaves room for a
	// slow link and a lost packet.
	DefaultHandshakeTimeout = 3 * time.Second
	// DefaultReadTimeout bounds reading a whole request, body included.
	DefaultReadTimeout = 15 * time.Second
	// DefaultWriteTimeout leaves room for a TokenRequest round trip to the
	// API server.
	DefaultWriteTimeout = 30 * time.Second
	// DefaultIdleTimeout closes idle keep-alive connections.
	DefaultIdleTimeout = 90 * time.Second
	// DefaultMaxConnsPerIP bounds the open connections of one client
	// address on each TLS listener, handshakes included: a client that
	// opens connections and sends nothing holds them for the handshake
	// timeout at most. It is above
	// DefaultMaxConnsPerIdentity, since a NAT or a load balancer puts
	// several peers behind one address.
	DefaultMaxConnsPerIP = 512
	// DefaultMaxConnsPerIdentity bounds the open connections of one
	// verified identity on the mutual-TLS listener. An agent keeps one or
	// two alive, but every kubectl that runs the exec credential plugin
	// in a source cluster connects as that cluster: 200 at once are
	// served (test/e2e/hostile_test.go).
	DefaultMaxConnsPerIdentity = 256
	// DefaultMaxConns bounds the open connections of all TLS listeners
	// together, handshakes included, and DefaultMaxHandshakes those still
	// in their TLS handshake; DefaultMaxHandshakesPerIP bounds the latter
	// for one client address on each TLS listener. They are sized to the
	// 256Mi memory limit that deploy/base and the chart ship
	// (docs/operations.md, "Memory"): a connection costs the broker at
	// most about 46 KiB of RSS (an idle kept-alive one; a handshake
	// stalled after its ClientHello about 45 KiB), so 2048 of them take at
	// most 92 MiB beside the broker's own 100 MiB with 50,000 leases listed
	// four times at once (test/e2e/memory_test.go measures both). Half of
	// the places may be handshakes, so that a flood of stalled ones leaves
	// the other half to established peers. 256 handshakes of one address
	// let the 200 kubectls of a source cluster connect at once
	// (test/e2e/hostile_test.go), as DefaultMaxConnsPerIdentity does.
	DefaultMaxConns           = 2048
	DefaultMaxHandshakes      = 1024
	DefaultMaxHandshakesPerIP = 256
	// DefaultShutdownGrace fits inside Kubernetes' default 30s
	// terminationGracePeriodSeconds.
	DefaultShutdownGrace = 20 * time.Second
	// DefaultReadyTimeout bounds one readiness check.
	DefaultReadyTimeout = 2 * time.Second
)

// Config is the typed configuration of a Server. Zero durations and sizes
// take the Default values; negative ones are an error.
type Config struct {
	// Addr is the address of the mutual-TLS API listener, e.g. ":8443".
	// Ignored when Listener is set.
	Addr string
	// Listener, if set, is used for the API instead of listening on Addr
	// (tests pass a 127.0.0.1:0 listener). It is a plain TCP listener; the
	// server wraps it in TLS. Run closes it.
	Listener net.Listener
	// OpsAddr is the address of the plain-HTTP operations listener
	// (/healthz, /readyz, /metrics). Ignored when OpsListener is set.
	OpsAddr string
	// OpsListener, if set, is used instead of listening on OpsAddr. Run
	// closes it.
	OpsListener net.Listener
	// TLSConfig is the server TLS configuration, built by the pki package.
	// It must require and verify client certificates.
	TLSConfig *tls.Config
	// ClientCAs, if set, is the client-CA bundle in force. A request whose
	// verified chain does not end at one of its certificates is refused
	// with 401, so that a keep-alive connection opened before a CA was
	// removed from the bundle (at the end of a CA rotation) stops working
	// too; new connections are refused by the TLS handshake.
	ClientCAs TrustAnchors

	// EnrollAddr is the address of the enrollment listener, e.g. ":8444";
	// empty (and no EnrollListener) means no enrollment listener. Ignored
	// when EnrollListener is set.
	EnrollAddr string
	// EnrollListener, if set, is used for enrollment instead of listening
	// on EnrollAddr. Run closes it.
	EnrollListener net.Listener
	// EnrollTLSConfig is the enrollment listener's TLS configuration
	// (pki.EnrollmentTLSConfig): TLS 1.3, a server certificate, no client
	// certificate. Required with an enrollment listener.
	EnrollTLSConfig *tls.Config

	// GatewayAddr is the address of the lease gateway's listener; empty
	// (and no GatewayListener) means none. GatewayListener, if set, is
	// used instead and closed by Run. GatewayTLSConfig is its TLS
	// configuration (pki.GatewayTLSConfig) and Gateway its handler;
	// both are required with the listener.
	GatewayAddr      string
	GatewayListener  net.Listener
	GatewayTLSConfig *tls.Config
	Gateway          GatewayHandler

	// MaxBodyBytes bounds every request body; a larger one is answered 413.
	MaxBodyBytes int64
	// MaxHeaderBytes bounds the request line and headers.
	MaxHeaderBytes int
	// ReadHeaderTimeout, ReadTimeout, WriteTimeout and IdleTimeout are the
	// http.Server timeouts; they are always set.
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration
	// HandshakeTimeout bounds the TLS handshake of a connection on each
	// TLS listener, which the listener does before net/http reads the
	// request. It must be shorter than ReadHeaderTimeout.
	HandshakeTimeout time.Duration
	// MaxConnsPerIP bounds the open connections from one client address
	// on each TLS listener, counted from accept; one more is closed before
	// its handshake. MaxConnsPerIdentity bounds those of one verified
	// identity on the mutual-TLS listener; one more is closed after its
	// handshake. Behind a load balancer that does not keep the client's
	// address every peer shares the balancer's, so raise MaxConnsPerIP
	// there.
	MaxConnsPerIP       int
	MaxConnsPerIdentity int
	// MaxConns bounds the open connections of all TLS listeners together,
	// counted from accept, and MaxHandshakes those of them still in their
	// TLS handshake; MaxHandshakesPerIP bounds the connections of one
	// client address in their handshake, on each TLS listener. One more
	// is closed as soon as it is accepted, before any TLS state is made
	// for it. They bound the memory the broker spends on connections
	// whatever the number of client addresses; an established connection
	// is never closed for a new one.
	MaxConns           int
	MaxHandshakes      int
	MaxHandshakesPerIP int
	// ShutdownGrace is how long Run waits for in-flight requests after its
	// context is cancelled before closing connections.
	ShutdownGrace time.Duration
	// ShutdownDelay is how long Run keeps its listeners open after its
	// context is cancelled, before ShutdownGrace starts: /readyz answers
	// 503 and keep-alives are off meanwhile, so that load balancers and
	// the Service's endpoints move new connections elsewhere. Zero closes
	// them at once. With ReusePort it ends as soon as another instance
	// serves on the same ports (handover.go).
	ShutdownDelay time.Duration
	// ReusePort opens the listeners with SO_REUSEPORT, so that a new
	// instance on the node's network (hostNetwork) listens beside the one
	// it replaces.
	ReusePort bool
	// Clock times ShutdownDelay; nil means the real clock.
	Clock clock.WithTicker
	// Pprof serves net/http/pprof under /debug/pprof/ on the operations
	// listener.
	Pprof bool
	// ReadyTimeout bounds the Broker.Ready call of /readyz.
	ReadyTimeout time.Duration

	// Logger receives the access log and the causes of errors. Nil means
	// no logging.
	Logger *zap.Logger
	// Registerer and Gatherer are the metrics registry (normally one
	// *prometheus.Registry given as both). When both are nil the server
	// makes a private registry; setting only one is an error.
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer
	// Broker is the domain core. Required.
	Broker Broker
	// Now is the clock used for request durations and for checking that a
	// client certificate is still valid on a long-lived connection. Nil
	// means time.Now.
	Now func() time.Time
}

// withDefaults returns a copy of c with defaults filled in, or an error if c
// cannot work.
func (c Config) withDefaults() (Config, error) {
	var errs []error
	if c.Broker == nil {
		errs = append(errs, errors.New("Broker is required"))
	}
	if c.TLSConfig == nil {
		errs = append(errs, errors.New("TLSConfig is required"))
	} else if err := checkTLSConfig(c.TLSConfig); err != nil {
		errs = append(errs, err)
	}
	if c.Listener == nil && c.Addr == "" {
		errs = append(errs, errors.New("Addr or Listener is required"))
	}
	if c.OpsListener == nil && c.OpsAddr == "" {
		errs = append(errs, errors.New("OpsAddr or OpsListener is required"))
	}
	if (c.GatewayListener != nil || c.GatewayAddr != "") && (c.GatewayTLSConfig == nil || c.Gateway == nil) {
		errs = append(errs, errors.New("GatewayTLSConfig and Gateway are required with a gateway listener"))
	}
	if c.EnrollListener != nil || c.EnrollAddr != "" {
		if c.EnrollTLSConfig == nil {
			errs = append(errs, errors.New("EnrollTLSConfig is required with an enrollment listener"))
		} else if err := checkEnrollTLSConfig(c.EnrollTLSConfig); err != nil {
			errs = append(errs, err)
		}
	}
	if (c.Registerer == nil) != (c.Gatherer == nil) {
		errs = append(errs, errors.New("Registerer and Gatherer must be set together"))
	}

	positive := func(name string, v *time.Duration, def time.Duration) {
		switch {
		case *v < 0:
			errs = append(errs, fmt.Errorf("%s must not be negative", name))
		case *v == 0:
			*v = def
		}
	}
	positive("ReadHeaderTimeout", &c.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	positive("ReadTimeout", &c.ReadTimeout, DefaultReadTimeout)
	positive("WriteTimeout", &c.WriteTimeout, DefaultWriteTimeout)
	positive("IdleTimeout", &c.IdleTimeout, DefaultIdleTimeout)
	positive("HandshakeTimeout", &c.HandshakeTimeout, DefaultHandshakeTimeout)
	if c.ReadHeaderTimeout > 0 && c.HandshakeTimeout >= c.ReadHeaderTimeout {
		// A handshake is the part a client without a certificate can
		// stall; it must not hold its slot longer than a peer's headers.
		errs = append(errs, fmt.Errorf("HandshakeTimeout (%s) must be shorter than ReadHeaderTimeout (%s)", c.HandshakeTimeout, c.ReadHeaderTimeout))
	}
	positive("ShutdownGrace", &c.ShutdownGrace, DefaultShutdownGrace)
	if c.ShutdownDelay < 0 {
		errs = append(errs, errors.New("ShutdownDelay must not be negative"))
	}
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	positive("ReadyTimeout", &c.ReadyTimeout, DefaultReadyTimeout)

	switch {
	case c.MaxBodyBytes < 0:
		errs = append(errs, errors.New("MaxBodyBytes must not be negative"))
	case c.MaxBodyBytes == 0:
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	switch {
	case c.MaxHeaderBytes < 0:
		errs = append(errs, errors.New("MaxHeaderBytes must not be negative"))
	case c.MaxHeaderBytes == 0:
		c.MaxHeaderBytes = DefaultMaxHeaderBytes
	}

	for _, f := range []struct {
		name string
		v    *int
		def  int
	}{
		{"MaxConnsPerIP", &c.MaxConnsPerIP, DefaultMaxConnsPerIP},
		{"MaxConnsPerIdentity", &c.MaxConnsPerIdentity, DefaultMaxConnsPerIdentity},
		{"MaxConns", &c.MaxConns, DefaultMaxConns},
		{"MaxHandshakes", &c.MaxHandshakes, DefaultMaxHandshakes},
		{"MaxHandshakesPerIP", &c.MaxHandshakesPerIP, DefaultMaxHandshakesPerIP},
	} {
		switch {
		case *f.v < 0:
			errs = append(errs, fmt.Errorf("%s must not be negative", f.name))
		case *f.v == 0:
			*f.v = f.def
		}
	}

	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Registerer == nil && c.Gatherer == nil {
		reg := prometheus.NewRegistry()
		c.Registerer, c.Gatherer = reg, reg
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if err := errors.Join(errs...); err != nil {
		return Config{}, fmt.Errorf("server config: %w", err)
	}
	return c, nil
}

// checkTLSConfig refuses a configuration that would let a request reach a
// handler without a verified client certificate. A configuration that
// chooses per connection (GetConfigForClient) cannot be checked here; the
// authentication middleware still refuses requests without a verified chain.
func checkTLSConfig(c *tls.Config) error {
	if c.GetConfigForClient != nil {
		return nil
	}
	var errs []error
	if c.ClientAuth != tls.RequireAndVerifyClientCert {
		errs = append(errs, errors.New("TLSConfig must require and verify client certificates"))
	}
	if c.MinVersion < tls.VersionTLS13 {
		errs = append(errs, errors.New("TLSConfig must require TLS 1.3"))
	}
	if len(c.Certificates) == 0 && c.GetCertificate == nil {
		errs = append(errs, errors.New("TLSConfig has no server certificate"))
	}
	return errors.Join(errs...)
}

// checkEnrollTLSConfig refuses an enrollment configuration below TLS 1.3 or
// without a server certificate.
func checkEnrollTLSConfig(c *tls.Config) error {
	var errs []error
	if c.MinVersion < tls.VersionTLS13 {
		errs = append(errs, errors.New("EnrollTLSConfig must require TLS 1.3"))
	}
	if len(c.Certificates) == 0 && c.GetCertificate == nil && c.GetConfigForClient == nil {
		errs = append(errs, errors.New("EnrollTLSConfig has no server certificate"))
	}
	return errors.Join(errs...)
}
