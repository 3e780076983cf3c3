package enrollment

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Config is the CA side's configuration (the broker's
// Config.Enrollment).
type Config struct {
	// CA signs client certificates at enrollment and renewal; nil disables
	// both (they answer KindNotFound).
	CA CertificateAuthority
	// JoinTokens verifies join tokens; nil means a pki.JoinTokenVerifier
	// that trusts the keys of CA and PreviousCA only.
	JoinTokens JoinTokenVerifier
	// PreviousCA, if set, is the signing CA being replaced during a CA
	// rotation: join tokens it signed still verify, and client
	// certificates it issued may still renew. The other CAs of Trust
	// authenticate peers but are never taken for signing CAs.
	PreviousCA CACertificates
	// BrokerNames are the names this broker answers to in a join token's
	// aud (pki join-token --audience); empty means the policy's
	// cluster.name, read at every verification. A token that names none
	// of them is refused, so that a token made for one broker cannot be
	// replayed at another broker of the same CA.
	BrokerNames []string
	// AcceptUnboundJoinTokens also accepts join tokens that name no broker
	// (aud pki.JoinTokenAudience, as made before audiences existed): the
	// old behaviour, for the tokens in flight during an upgrade.
	AcceptUnboundJoinTokens bool
	// Trust is the CA bundle served by TrustBundle and returned with every
	// issued certificate.
	Trust TrustSource
	// CertificateTTL is the lifetime of issued client certificates unless
	// the policy sets one for the peer; zero means
	// pki.DefaultClientLifetime.
	CertificateTTL time.Duration
	// Revocations is the deny list; nil means nothing is revoked. While it
	// is not synced the broker is not ready.
	Revocations *RevocationList
	// SignClusterCAs answers a request's clusterCACSR with the cluster's
	// CA (pki.CA.SignClusterCA), signed by CA, which must then allow it
	// (pki.CA.CheckSignsClusterCAs) and be a ClusterCASigner. Off (the
	// default), such a request is refused whole.
	SignClusterCAs bool
}

// Authority is the CA side of the broker: it enrolls new clusters with
// their join tokens and renews the certificates of known ones, within the
// enrollment and renewal limits, and ends every request in one audit
// event. CA nil answers both with KindNotFound.
type Authority struct {
	Config
	Policy *policy.Store
	// Secrets and Namespace are where used join tokens are recorded.
	Secrets   corev1client.SecretsGetter
	Namespace string
	// Limits admits renewals and enrollments.
	Limits  *limits.Admission
	Audit   *audit.Recorder
	Metrics *metrics.Metrics
	Clock   clock.PassiveClock
	Logger  *zap.Logger
	// Timed records one API server call.
	Timed func(ctx context.Context, call string, start time.Time, err error) time.Duration
}

// Peer is the caller of a renewal as the transport authenticated it.
type Peer struct {
	Identity   string
	CertSHA256 string
	// Certificate is the verified client certificate; nil refuses.
	Certificate *x509.Certificate
}

// JoinTokenAudiences are the aud values a broker accepts in a join
// token: its names (brokerNames, else the policy's cluster.name), and
// the unbound audience if acceptUnbound.
func JoinTokenAudiences(brokerNames []string, store *policy.Store, acceptUnbound bool) []string {
	names := slices.Clone(brokerNames)
	if len(names) == 0 {
		// Policy.Validate refuses a cluster.name that is no broker name
		// (the unbound audience); this keeps it out even so.
		if p := store.Load(); p != nil && pki.ValidJoinTokenAudience(p.Cluster.Name) == nil {
			names = append(names, p.Cluster.Name)
		}
	}
	if acceptUnbound {
		names = append(names, pki.JoinTokenAudience)
	}
	return names
}

// issuedBySigningCA reports whether cert was signed by the key of the
// signing CA in force or of the previous one.
func (auth *Authority) issuedBySigningCA(cert *x509.Certificate) bool {
	if cert == nil {
		return false
	}
	for _, ca := range SigningCAs(auth.CA, auth.PreviousCA) {
		if bytes.Equal(cert.RawIssuer, ca.RawSubject) && cert.CheckSignatureFrom(ca) == nil {
			return true
		}
	}
	return false
}

// caExpirySlack keeps a shortened certificate's NotAfter clear of the
// CA's, whatever the clocks of broker and CA say.
const caExpirySlack = time.Minute

// Operations and outcomes of tokenbroker_certificate_requests_total.
const (
	opEnroll = "enroll"
	opRenew  = "renew"

	certIssued          = "issued"
	certUnauthenticated = "unauthenticated"
	certInvalid         = "invalid"
	certDenied          = "denied"
	certUnavailable     = "unavailable"
	certDisabled        = "disabled"
	certError           = "error"
	certLimited         = "limited"
)

// errJoinToken is every enrollment authentication failure as the caller
// sees it: bad, expired, reused or revoked, all the same.
func errJoinToken(cause error) error {
	return problem.Wrap(problem.KindUnauthenticated, "invalid join token", cause)
}

// errCertificatesDisabled answers enrollment and renewal on a broker that
// has no signing CA.
var errCertificatesDisabled = problem.Errorf(problem.KindNotFound, "this broker does not issue certificates")

// Enroll issues a new cluster's first client certificate. token is the
// join token the caller presented as its bearer token; it authorizes one
// certificate for its subject, once.
//
// Every problem with the token (malformed, badly signed, expired, wrong
// issuer or audience, already used, or for a revoked identity) is the same
// KindUnauthenticated error, so that a caller learns nothing about why.
// Then a CSR that does not parse is KindInvalid with a field error on
// "csr", and a CSR for another identity than the token's subject is
// KindForbidden; neither uses the token up. The token's jti is then
// recorded in the Kubernetes API with a create that fails if the record
// exists, before anything is signed, so that of two replicas given the
// same token only one issues a certificate. KindUnavailable (API server
// unreachable, token not used up) is retryable.
//
// A request with a clusterCACSR also gets the cluster's CA, checked like
// the CSR (field "clusterCACSR") and signed with the certificate, or is
// refused whole, before the token is used up: KindUnprocessable with a
// field error on "clusterCACSR" when Config.SignClusterCAs is off.
func (auth *Authority) Enroll(ctx context.Context, addr, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	a := &audit.Pending{Event: audit.Event{Action: audit.ActionEnroll}}
	resp, outcome, err := auth.enroll(ctx, addr, token, req, a)
	auth.Metrics.ObserveCertificate(opEnroll, outcome)
	auth.auditCertificate(ctx, a, outcome, resp, err)
	return resp, err
}

// auditCertificate writes the audit event of an enrollment or renewal.
func (auth *Authority) auditCertificate(ctx context.Context, a *audit.Pending, outcome string, resp *apiv1.CertificateResponse, err error) {
	switch outcome {
	case certIssued:
		a.Event.Serial = resp.SerialNumber
		a.Event.NotAfter = resp.NotAfter.UTC().Format(time.RFC3339)
		auth.Audit.Conclude(ctx, a, audit.DecisionAllow, "", "")
	case certUnavailable:
		auth.Audit.Conclude(ctx, a, audit.DecisionError, "the Kubernetes API server is unavailable", "")
	case certError:
		auth.Audit.Conclude(ctx, a, audit.DecisionError, problem.Detail(err), "")
	default:
		auth.Audit.Conclude(ctx, a, audit.DecisionDeny, problem.Detail(err), audit.DenyInvalid)
	}
}

func (auth *Authority) enroll(ctx context.Context, addr, token string, req apiv1.CertificateRequest, a *audit.Pending) (*apiv1.CertificateResponse, string, error) {
	if auth.CA == nil {
		a.Denial = audit.DenyDisabled
		return nil, certDisabled, errCertificatesDisabled
	}
	log := auth.Logger.With(zap.String("operation", opEnroll))
	p, err := auth.Policy.Current()
	if err == nil {
		err = auth.Limits.Enrollment(p, addr, token, a)
	}
	if err != nil {
		log.Info("enrollment refused", zap.String("reason", problem.Detail(err)))
		return nil, certLimited, err
	}
	claims, err := auth.JoinTokens.Verify(token)
	if err != nil {
		log.Info("enrollment refused", zap.String("reason", "join token not valid"), zap.Error(err))
		a.Denial, a.Reason = audit.DenyJoinToken, "join token not valid: "+err.Error()
		return nil, certUnauthenticated, errJoinToken(err)
	}
	log = log.With(zap.String("identity", claims.Identity), zap.String("jti", claims.ID))
	a.Event.Identity, a.Event.JoinTokenID = claims.Identity, claims.ID
	if auth.revoked(claims.Identity) {
		log.Info("enrollment refused", zap.String("reason", "identity revoked"))
		a.Denial, a.Reason = audit.DenyRevoked, "identity revoked"
		return nil, certUnauthenticated, errJoinToken(errors.New("identity is revoked"))
	}
	csrs, outcome, err := auth.parseCSRs(req, claims.Identity, a)
	if err != nil {
		log.Info("enrollment refused", zap.String("reason", problem.Detail(err)), zap.Error(err))
		return nil, outcome, err
	}
	if err := auth.recordJoinToken(ctx, claims); err != nil {
		log.Info("enrollment refused", zap.String("reason", problem.Detail(err)), zap.Error(err))
		if problem.KindOf(err) == problem.KindUnauthenticated {
			a.Denial, a.Reason = audit.DenyJoinToken, "join token already used"
		}
		return nil, outcomeOfCert(err), err
	}
	// If signing fails, the token is used up: a CA that cannot sign is an
	// operator problem, and a second chance would need a second record.
	return auth.signLogged(csrs, claims.Identity, log, a, "enrollment failed after the join token was used", "certificate enrolled")
}

// requestedCSRs are the parsed CSRs of a certificate request: the client
// certificate's, and the cluster CA's when the request has one.
type requestedCSRs struct {
	client, clusterCA *x509.CertificateRequest
}

// parseCSRs parses the request's CSRs for identity, and refuses a
// clusterCACSR that this broker does not sign, all before anything is
// used up or signed: the answer is all of the request or an error.
func (auth *Authority) parseCSRs(req apiv1.CertificateRequest, identity string, a *audit.Pending) (requestedCSRs, string, error) {
	csr, err := ParseCSR(req.CSR, identity)
	if err != nil {
		a.Denial = csrDenial(err)
		return requestedCSRs{}, outcomeOfCert(err), err
	}
	out := requestedCSRs{client: csr}
	if req.ClusterCACSR == "" {
		return out, "", nil
	}
	signer, ok := auth.CA.(ClusterCASigner)
	if !ok || !auth.SignClusterCAs {
		a.Denial, a.Reason = audit.DenyDisabled, "this broker does not sign cluster CAs"
		return requestedCSRs{}, certDisabled, errClusterCAsDisabled
	}
	// A signing CA replaced by one that cannot sign CAs is the operator's
	// to fix; the join token is not used up meanwhile.
	if err := signer.CheckSignsClusterCAs(); err != nil {
		return requestedCSRs{}, certError, fmt.Errorf("sign cluster CAs: %w", err)
	}
	if out.clusterCA, err = parseClusterCACSR(req.ClusterCACSR, identity, csr); err != nil {
		a.Denial = csrDenial(err)
		return requestedCSRs{}, outcomeOfCert(err), err
	}
	return out, "", nil
}

// signLogged signs csrs for identity, logs the outcome with failed or
// done, and records the cluster CA signed in a's event (auditCertificate
// records the client certificate).
func (auth *Authority) signLogged(csrs requestedCSRs, identity string, log *zap.Logger, a *audit.Pending, failed, done string) (*apiv1.CertificateResponse, string, error) {
	resp, clusterCA, err := auth.sign(csrs, identity, log)
	if err != nil {
		log.Error(failed, zap.Error(err))
		return nil, outcomeOfCert(err), err
	}
	fields := []zap.Field{zap.String("serial", resp.SerialNumber), zap.Time("not_after", resp.NotAfter)}
	if clusterCA != nil {
		a.Event.ClusterCASerial = clusterCA.SerialNumber.Text(16)
		a.Event.ClusterCANotAfter = clusterCA.NotAfter.UTC().Format(time.RFC3339)
		fields = append(fields, zap.String("cluster_ca_serial", a.Event.ClusterCASerial), zap.Time("cluster_ca_not_after", clusterCA.NotAfter))
	}
	log.Info(done, fields...)
	return resp, certIssued, nil
}

// Renew issues a new certificate to a caller authenticated by its current,
// verified and unrevoked client certificate, for the same identity and a
// new key if the caller wants one. A client certificate that the signing
// CA (or Config.PreviousCA) did not issue, an identity that is not a peer
// in the policy and a CSR for another identity are KindForbidden; a CSR
// that does not parse is KindInvalid. A clusterCACSR is answered as by
// Enroll, with a cluster CA of the signing CA in force.
func (auth *Authority) Renew(ctx context.Context, c Peer, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	a := &audit.Pending{Event: audit.Event{Action: audit.ActionRenew, Identity: c.Identity, CertSHA256: c.CertSHA256}}
	resp, outcome, err := auth.renew(c, req, a)
	auth.Metrics.ObserveCertificate(opRenew, outcome)
	auth.auditCertificate(ctx, a, outcome, resp, err)
	return resp, err
}

func (auth *Authority) renew(c Peer, req apiv1.CertificateRequest, a *audit.Pending) (*apiv1.CertificateResponse, string, error) {
	if auth.CA == nil {
		a.Denial = audit.DenyDisabled
		return nil, certDisabled, errCertificatesDisabled
	}
	log := auth.Logger.With(zap.String("operation", opRenew), zap.String("identity", c.Identity),
		zap.String("client_cert_sha256", c.CertSHA256))
	// The transport checked the certificate's serial and identity against
	// the deny list; the identity is checked again here so that Renew is
	// safe whoever calls it.
	if auth.revoked(c.Identity) {
		log.Info("renewal refused", zap.String("reason", "identity revoked"))
		a.Denial, a.Reason = audit.DenyRevoked, "identity revoked"
		return nil, certUnauthenticated, problem.Wrap(problem.KindUnauthenticated, "", errors.New("identity is revoked"))
	}
	// Only certificates of the signing CA (or the previous one) renew: a
	// peer authenticated by another CA of the trust bundle gets its
	// certificates from that CA.
	if !auth.issuedBySigningCA(c.Certificate) {
		log.Info("renewal refused", zap.String("reason", "client certificate not issued by the signing CA"))
		a.Denial, a.Reason = audit.DenyNotSigningCA, "client certificate not issued by the signing CA"
		return nil, certDenied, problem.Wrap(problem.KindForbidden, "", errors.New("the client certificate was not issued by this broker's signing CA"))
	}
	// A peer removed from the policy has no business here any more: it
	// keeps its certificate until it expires, but gets no new one.
	p := auth.Policy.Load()
	if p == nil || p.Peer(c.Identity) == nil {
		log.Info("renewal refused", zap.String("reason", "not a peer in the policy"))
		a.Denial, a.Reason = audit.DenyNotAPeer, "not a peer in the policy"
		return nil, certDenied, problem.Wrap(problem.KindForbidden, "", errors.New("the identity is not a peer in the policy"))
	}
	if err := auth.Limits.Renewal(p, c.Identity, a); err != nil {
		log.Info("renewal refused", zap.String("reason", problem.Detail(err)))
		return nil, certLimited, err
	}
	csrs, outcome, err := auth.parseCSRs(req, c.Identity, a)
	if err != nil {
		log.Info("renewal refused", zap.String("reason", problem.Detail(err)), zap.Error(err))
		return nil, outcome, err
	}
	return auth.signLogged(csrs, c.Identity, log, a, "renewal failed", "certificate renewed")
}

// TrustBundle returns the CA bundle in force and the fingerprints of its
// certificates; both are empty when the broker has no TrustSource.
func (auth *Authority) TrustBundle() apiv1.TrustBundle {
	out := apiv1.TrustBundle{Fingerprints: []string{}}
	if auth.Trust == nil {
		return out
	}
	out.CABundle = string(auth.Trust.PEM())
	for _, c := range auth.Trust.Certificates() {
		out.Fingerprints = append(out.Fingerprints, pki.Fingerprint(c))
	}
	return out
}

// revoked reports whether identity is on the deny list.
func (auth *Authority) revoked(identity string) bool {
	return auth.Revocations != nil && auth.Revocations.Revoked(identity)
}

// recordJoinToken creates the used-token record, failing with the
// uniform KindUnauthenticated error if it exists already.
func (auth *Authority) recordJoinToken(ctx context.Context, claims pki.JoinTokenClaims) error {
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      UsedJoinTokenSecretName(claims.ID),
			Namespace: auth.Namespace,
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue,
				objects.LabelKind:      objects.UsedJoinTokenKind,
			},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: claims.ExpiresAt.Add(UsedJoinTokenMargin).UTC().Format(time.RFC3339),
				objects.AnnotationIdentity:  claims.Identity,
				AnnotationJoinTokenID:       claims.ID,
			},
		},
		Type: objects.SecretTypeUsedJoinToken,
	}
	t0 := auth.Clock.Now()
	_, err := auth.Secrets.Secrets(auth.Namespace).Create(ctx, s, metav1.CreateOptions{})
	auth.Timed(ctx, "create_used_join_token", t0, err)
	switch {
	case err == nil:
		return nil
	case apierrors.IsAlreadyExists(err):
		return errJoinToken(fmt.Errorf("join token already used (record %s/%s exists)", auth.Namespace, s.Name))
	case apierrors.IsNotFound(err):
		// The broker's own namespace is missing: an operator problem.
		return problem.Wrap(problem.KindInternal, "", fmt.Errorf("record used join token in namespace %q: %w", auth.Namespace, err))
	}
	return problem.Classify(err, "record used join token", "namespace not found")
}

// sign issues the certificate for identity with the peer's lifetime,
// shortened (and logged) when the CA expires sooner: near the end of a CA's
// life clusters get shorter certificates rather than none. With a cluster
// CA's CSR it also signs the cluster CA, with the same lifetime and CA,
// and returns it; if either fails, neither is answered.
func (auth *Authority) sign(csrs requestedCSRs, identity string, log *zap.Logger) (*apiv1.CertificateResponse, *x509.Certificate, error) {
	ttl := auth.CertificateTTL
	if p := auth.Policy.Load(); p != nil {
		ttl = p.CertificateTTL(identity, ttl)
	}
	if left := auth.CA.Certificate().NotAfter.Sub(auth.Clock.Now()) - caExpirySlack; ttl > left && left >= policy.MinCertificateTTL {
		log.Warn("certificate lifetime shortened: the signing CA expires sooner; rotate the CA",
			zap.Duration("ttl", ttl), zap.Duration("granted", left.Truncate(time.Second)),
			zap.Time("ca_not_after", auth.CA.Certificate().NotAfter))
		ttl = left.Truncate(time.Second)
	}
	t0 := auth.Clock.Now()
	kp, err := auth.CA.SignClient(csrs.client, identity, ttl)
	auth.Metrics.ObserveAPI("sign_client_certificate", auth.Clock.Since(t0))
	if err != nil {
		if errors.Is(err, pki.ErrInvalidCSR) {
			return nil, nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid",
				Fields: []apiv1.FieldError{{Field: "csr", Detail: CSRProblem(err)}}, Err: err}
		}
		return nil, nil, fmt.Errorf("sign client certificate for %s: %w", identity, err)
	}
	resp := &apiv1.CertificateResponse{
		Identity:     identity,
		Certificate:  string(kp.CertPEM),
		SerialNumber: kp.Cert.SerialNumber.Text(16),
		NotBefore:    kp.Cert.NotBefore.UTC(),
		NotAfter:     kp.Cert.NotAfter.UTC(),
	}
	if auth.Trust != nil {
		resp.CABundle = string(auth.Trust.PEM())
	}
	if csrs.clusterCA == nil {
		return resp, nil, nil
	}
	signer, ok := auth.CA.(ClusterCASigner)
	if !ok {
		return nil, nil, errClusterCAsDisabled
	}
	t0 = auth.Clock.Now()
	ca, err := signer.SignClusterCA(csrs.clusterCA, identity, ttl)
	auth.Metrics.ObserveAPI("sign_cluster_ca", auth.Clock.Since(t0))
	if err != nil {
		if errors.Is(err, pki.ErrInvalidCSR) {
			return nil, nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid",
				Fields: []apiv1.FieldError{{Field: fieldClusterCACSR, Detail: clusterCACSRProblem(err)}}, Err: err}
		}
		return nil, nil, fmt.Errorf("sign cluster CA for %s: %w", identity, err)
	}
	notAfter := ca.Cert.NotAfter.UTC()
	resp.ClusterCA, resp.ClusterCANotAfter = string(ca.CertPEM), &notAfter
	return resp, ca.Cert, nil
}

// csrDenial is the denial reason code of a refused CSR.
func csrDenial(err error) string {
	if problem.KindOf(err) == problem.KindForbidden {
		return audit.DenyIdentityMismatch
	}
	return audit.DenyInvalid
}

// certOutcomes label a certificate request that failed, by the kind of
// its error.
var certOutcomes = map[problem.Kind]string{
	problem.KindUnauthenticated: certUnauthenticated,
	problem.KindInvalid:         certInvalid,
	problem.KindForbidden:       certDenied,
	problem.KindUnavailable:     certUnavailable,
	problem.KindTooManyRequests: certLimited,
}

func outcomeOfCert(err error) string { return problem.Label(err, certOutcomes, certError) }
