package broker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// CertificateAuthority signs client certificates for enrolled and renewing
// clusters; *pki.CA is the implementation.
type CertificateAuthority interface {
	// SignClient issues a client certificate for identity with the CSR's
	// public key. Errors wrapping pki.ErrInvalidCSR are the caller's fault;
	// none is retryable.
	SignClient(csr *x509.CertificateRequest, identity string, lifetime time.Duration) (*pki.KeyPair, error)
	// Certificate is the signing CA's certificate; its key signs join
	// tokens.
	Certificate() *x509.Certificate
}

// TrustSource is the CA bundle in force, which peers use to verify brokers
// and each other; *pki.PoolReloader (the client-CA bundle, which follows
// its file) is the implementation.
type TrustSource interface {
	// PEM is the bundle as served by GET /v1/trust-bundle.
	PEM() []byte
	// Certificates are the bundle's certificates, in the same order.
	Certificates() []*x509.Certificate
}

// JoinTokenVerifier checks a join token's signature and claims (not its
// single use, which the broker records); *pki.JoinTokenVerifier is the
// implementation.
type JoinTokenVerifier interface {
	Verify(token string) (pki.JoinTokenClaims, error)
}

var (
	_ CertificateAuthority = (*pki.CA)(nil)
	_ CertificateAuthority = (*pki.CAReloader)(nil)
	_ TrustSource          = (*pki.PoolReloader)(nil)
	_ JoinTokenVerifier    = (*pki.JoinTokenVerifier)(nil)
	_ JoinTokenVerifier    = caJoinTokens{}
	_ CACertificates       = (*pki.PoolReloader)(nil)
)

// CACertificates are CA certificates read at every use, so that they
// follow a file that changes; *pki.PoolReloader is the implementation.
type CACertificates interface {
	Certificates() []*x509.Certificate
}

// caJoinTokens verifies join tokens with the key of the signing CA in
// force and, during a rotation, of the previous signing CA named
// explicitly, both read at every verification so that they follow a
// signing CA that is replaced at run time. The other CAs of the trust
// bundle are not asked: a bundle CA authenticates peers, it does not
// admit new ones, and an operator who adds a partner's CA to the bundle
// must not thereby let that partner mint join tokens for this broker.
//
// The token's aud must name this broker (see Config.BrokerNames).
type caJoinTokens struct {
	ca        CertificateAuthority
	previous  CACertificates
	audiences func() []string
	now       func() time.Time
}

func (v caJoinTokens) Verify(token string) (pki.JoinTokenClaims, error) {
	return pki.NewJoinTokenVerifierFor(signingCAs(v.ca, v.previous), v.audiences(), v.now).Verify(token)
}

// joinTokenAudiences are the aud values this broker accepts in a join
// token: its names (Config.BrokerNames, else the policy's cluster.name),
// and the unbound audience if Config.AcceptUnboundJoinTokens.
func (b *Broker) joinTokenAudiences() []string {
	names := slices.Clone(b.cfg.BrokerNames)
	if len(names) == 0 {
		// Policy.Validate refuses a cluster.name that is no broker name
		// (the unbound audience); this keeps it out even so.
		if p := b.cfg.Policy.Load(); p != nil && pki.ValidJoinTokenAudience(p.Cluster.Name) == nil {
			names = append(names, p.Cluster.Name)
		}
	}
	if b.cfg.AcceptUnboundJoinTokens {
		names = append(names, pki.JoinTokenAudience)
	}
	return names
}

// signingCAs are the CAs whose keys may have signed join tokens and the
// client certificates that renew: the signing CA in force and the
// previous one.
func signingCAs(ca CertificateAuthority, previous CACertificates) []*x509.Certificate {
	out := []*x509.Certificate{ca.Certificate()}
	if previous != nil {
		out = append(out, previous.Certificates()...)
	}
	return out
}

// issuedBySigningCA reports whether cert was signed by the key of the
// signing CA in force or of the previous one.
func (b *Broker) issuedBySigningCA(cert *x509.Certificate) bool {
	if cert == nil {
		return false
	}
	for _, ca := range signingCAs(b.cfg.CA, b.cfg.PreviousCA) {
		if bytes.Equal(cert.RawIssuer, ca.RawSubject) && cert.CheckSignatureFrom(ca) == nil {
			return true
		}
	}
	return false
}

// The record of a used join token: a Secret with no data in the broker's
// namespace, named after the token's jti, so that creating it is the
// atomic "first use wins" that every replica agrees on.
const (
	AnnotationJoinTokenID      = "tokenbroker.io/jti"
	usedJoinTokenPrefix        = "tokenbroker-jti-"
	usedJoinTokenNameHexDigits = 40
	// usedJoinTokenMargin keeps a record past its token's exp, so that the
	// GC never deletes it while the verifier's leeway (and clock skew
	// between replicas) could still accept the token.
	usedJoinTokenMargin = 10 * time.Minute
	// usedJoinTokenFallbackRetention is how long the GC keeps a record
	// whose expiry annotation cannot be read: beyond the longest join token.
	usedJoinTokenFallbackRetention = pki.MaxJoinTokenTTL + usedJoinTokenMargin
	// caExpirySlack keeps a shortened certificate's NotAfter clear of the
	// CA's, whatever the clocks of broker and CA say.
	caExpirySlack = time.Minute
)

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

// errIdentityMismatch is the refusal of a CSR for another identity than the
// one the join token or the client certificate vouches for.
var errIdentityMismatch = problem.Errorf(problem.KindForbidden, "the CSR's identity is not the authenticated identity")

// UsedJoinTokenSecretName returns the name of the record of a used join
// token: a hash of the jti, so that the name is always valid whatever the
// jti looks like.
func UsedJoinTokenSecretName(jti string) string {
	sum := sha256.Sum256([]byte(jti))
	return usedJoinTokenPrefix + hex.EncodeToString(sum[:])[:usedJoinTokenNameHexDigits]
}

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
func (b *Broker) Enroll(ctx context.Context, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	a := &pendingAudit{ev: audit.Event{Action: audit.ActionEnroll}}
	resp, outcome, err := b.enroll(ctx, token, req, a)
	b.cfg.Metrics.ObserveCertificate(opEnroll, outcome)
	b.auditCertificate(ctx, a, outcome, resp, err)
	return resp, err
}

// auditCertificate writes the audit event of an enrollment or renewal.
func (b *Broker) auditCertificate(ctx context.Context, a *pendingAudit, outcome string, resp *apiv1.CertificateResponse, err error) {
	switch outcome {
	case certIssued:
		a.ev.Serial = resp.SerialNumber
		a.ev.NotAfter = resp.NotAfter.UTC().Format(time.RFC3339)
		b.conclude(ctx, a, audit.DecisionAllow, "", "")
	case certUnavailable:
		b.conclude(ctx, a, audit.DecisionError, "the Kubernetes API server is unavailable", "")
	case certError:
		b.conclude(ctx, a, audit.DecisionError, errDetail(err), "")
	default:
		b.conclude(ctx, a, audit.DecisionDeny, errDetail(err), denyInvalid)
	}
}

func (b *Broker) enroll(ctx context.Context, token string, req apiv1.CertificateRequest, a *pendingAudit) (*apiv1.CertificateResponse, string, error) {
	if b.cfg.CA == nil {
		a.denial = denyDisabled
		return nil, certDisabled, errCertificatesDisabled
	}
	log := b.cfg.Logger.With(zap.String("operation", opEnroll))
	if err := b.admitEnrollment(RemoteAddr(ctx), token, a); err != nil {
		log.Info("enrollment refused", zap.String("reason", errDetail(err)))
		return nil, certLimited, err
	}
	claims, err := b.joinTokens.Verify(token)
	if err != nil {
		log.Info("enrollment refused", zap.String("reason", "join token not valid"), zap.Error(err))
		a.denial, a.reason = denyJoinToken, "join token not valid: "+err.Error()
		return nil, certUnauthenticated, errJoinToken(err)
	}
	log = log.With(zap.String("identity", claims.Identity), zap.String("jti", claims.ID))
	a.ev.Identity, a.ev.JoinTokenID = claims.Identity, claims.ID
	if b.revoked(claims.Identity) {
		log.Info("enrollment refused", zap.String("reason", "identity revoked"))
		a.denial, a.reason = denyRevoked, "identity revoked"
		return nil, certUnauthenticated, errJoinToken(errors.New("identity is revoked"))
	}
	csr, err := parseCSR(req.CSR, claims.Identity)
	if err != nil {
		a.denial = csrDenial(err)
		log.Info("enrollment refused", zap.String("reason", errDetail(err)), zap.Error(err))
		return nil, outcomeOfCert(err), err
	}
	if err := b.recordJoinToken(ctx, claims); err != nil {
		log.Info("enrollment refused", zap.String("reason", errDetail(err)), zap.Error(err))
		if problem.KindOf(err) == problem.KindUnauthenticated {
			a.denial, a.reason = denyJoinToken, "join token already used"
		}
		return nil, outcomeOfCert(err), err
	}
	// If signing fails, the token is used up: a CA that cannot sign is an
	// operator problem, and a second chance would need a second record.
	return b.signLogged(csr, claims.Identity, log, "enrollment failed after the join token was used", "certificate enrolled")
}

// signLogged signs csr for identity and logs the outcome with failed or
// done.
func (b *Broker) signLogged(csr *x509.CertificateRequest, identity string, log *zap.Logger, failed, done string) (*apiv1.CertificateResponse, string, error) {
	resp, err := b.sign(csr, identity, log)
	if err != nil {
		log.Error(failed, zap.Error(err))
		return nil, outcomeOfCert(err), err
	}
	log.Info(done, zap.String("serial", resp.SerialNumber), zap.Time("not_after", resp.NotAfter))
	return resp, certIssued, nil
}

// Renew issues a new certificate to a caller authenticated by its current,
// verified and unrevoked client certificate, for the same identity and a
// new key if the caller wants one. A client certificate that the signing
// CA (or Config.PreviousCA) did not issue, an identity that is not a peer
// in the policy and a CSR for another identity are KindForbidden; a CSR
// that does not parse is KindInvalid.
func (b *Broker) Renew(ctx context.Context, c Caller, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	a := &pendingAudit{ev: audit.Event{Action: audit.ActionRenew, Identity: c.Identity, CertSHA256: c.CertSHA256}}
	resp, outcome, err := b.renew(c, req, a)
	b.cfg.Metrics.ObserveCertificate(opRenew, outcome)
	b.auditCertificate(ctx, a, outcome, resp, err)
	return resp, err
}

func (b *Broker) renew(c Caller, req apiv1.CertificateRequest, a *pendingAudit) (*apiv1.CertificateResponse, string, error) {
	if b.cfg.CA == nil {
		a.denial = denyDisabled
		return nil, certDisabled, errCertificatesDisabled
	}
	log := b.cfg.Logger.With(zap.String("operation", opRenew), zap.String("identity", c.Identity),
		zap.String("client_cert_sha256", c.CertSHA256))
	// The transport checked the certificate's serial and identity against
	// the deny list; the identity is checked again here so that Renew is
	// safe whoever calls it.
	if b.revoked(c.Identity) {
		log.Info("renewal refused", zap.String("reason", "identity revoked"))
		a.denial, a.reason = denyRevoked, "identity revoked"
		return nil, certUnauthenticated, problem.Wrap(problem.KindUnauthenticated, "", errors.New("identity is revoked"))
	}
	// Only certificates of the signing CA (or the previous one) renew: a
	// peer authenticated by another CA of the trust bundle gets its
	// certificates from that CA.
	if !b.issuedBySigningCA(c.Certificate) {
		log.Info("renewal refused", zap.String("reason", "client certificate not issued by the signing CA"))
		a.denial, a.reason = denyNotSigningCA, "client certificate not issued by the signing CA"
		return nil, certDenied, problem.Wrap(problem.KindForbidden, "", errors.New("the client certificate was not issued by this broker's signing CA"))
	}
	// A peer removed from the policy has no business here any more: it
	// keeps its certificate until it expires, but gets no new one.
	if p := b.cfg.Policy.Load(); p == nil || p.Peer(c.Identity) == nil {
		log.Info("renewal refused", zap.String("reason", "not a peer in the policy"))
		a.denial, a.reason = denyNotAPeer, "not a peer in the policy"
		return nil, certDenied, problem.Wrap(problem.KindForbidden, "", errors.New("the identity is not a peer in the policy"))
	}
	if err := b.admitRenewal(c.Identity, a); err != nil {
		log.Info("renewal refused", zap.String("reason", errDetail(err)))
		return nil, certLimited, err
	}
	csr, err := parseCSR(req.CSR, c.Identity)
	if err != nil {
		a.denial = csrDenial(err)
		log.Info("renewal refused", zap.String("reason", errDetail(err)), zap.Error(err))
		return nil, outcomeOfCert(err), err
	}
	return b.signLogged(csr, c.Identity, log, "renewal failed", "certificate renewed")
}

// TrustBundle returns the CA bundle in force and the fingerprints of its
// certificates; both are empty when the broker has no TrustSource.
func (b *Broker) TrustBundle() apiv1.TrustBundle {
	out := apiv1.TrustBundle{Fingerprints: []string{}}
	if b.cfg.Trust == nil {
		return out
	}
	out.CABundle = string(b.cfg.Trust.PEM())
	for _, c := range b.cfg.Trust.Certificates() {
		out.Fingerprints = append(out.Fingerprints, pki.Fingerprint(c))
	}
	return out
}

// Revoked reports whether a caller's identity or one of its certificate
// serials (hexadecimal, see NormalizeSerial) is on the deny list; false
// when the broker has no RevocationList.
func (b *Broker) Revoked(identity string, serials ...string) bool {
	if b.cfg.Revocations == nil {
		return false
	}
	return b.cfg.Revocations.Revoked(identity, serials...)
}

func (b *Broker) revoked(identity string) bool { return b.Revoked(identity) }

// parseCSR parses the CSR and checks that it asks for identity.
func parseCSR(csrPEM, identity string) (*x509.CertificateRequest, error) {
	csr, csrIdentity, err := pki.ParseCSRPEM([]byte(csrPEM))
	if err != nil {
		return nil, &problem.Error{
			Kind:   problem.KindInvalid,
			Detail: "the request is invalid",
			Fields: []apiv1.FieldError{{Field: "csr", Detail: csrProblem(err)}},
			Err:    err,
		}
	}
	if csrIdentity != identity {
		return nil, &problem.Error{Kind: problem.KindForbidden, Detail: errIdentityMismatch.Detail,
			Err: fmt.Errorf("CSR identity %q, authenticated identity %q", csrIdentity, identity)}
	}
	return csr, nil
}

// csrProblem is the caller-facing description of a refused CSR: pki's
// messages describe the CSR and hold nothing secret, but are bounded here
// all the same.
func csrProblem(err error) string {
	const maxLen = 300
	msg := err.Error()
	if len(msg) > maxLen {
		msg = msg[:maxLen] + "…"
	}
	return "must be one PEM CERTIFICATE REQUEST with the cluster identity as its only URI SAN: " + msg
}

// recordJoinToken creates the used-token record, failing with the
// uniform KindUnauthenticated error if it exists already.
func (b *Broker) recordJoinToken(ctx context.Context, claims pki.JoinTokenClaims) error {
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      UsedJoinTokenSecretName(claims.ID),
			Namespace: b.cfg.Namespace,
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue,
				objects.LabelKind:      objects.UsedJoinTokenKind,
			},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: claims.ExpiresAt.Add(usedJoinTokenMargin).UTC().Format(time.RFC3339),
				objects.AnnotationIdentity:  claims.Identity,
				AnnotationJoinTokenID:       claims.ID,
			},
		},
		Type: objects.SecretTypeUsedJoinToken,
	}
	t0 := b.cfg.Clock.Now()
	_, err := b.cfg.Secrets.Secrets(b.cfg.Namespace).Create(ctx, s, metav1.CreateOptions{})
	b.timeAPI(ctx, "create_used_join_token", t0, err)
	switch {
	case err == nil:
		return nil
	case apierrors.IsAlreadyExists(err):
		return errJoinToken(fmt.Errorf("join token already used (record %s/%s exists)", b.cfg.Namespace, s.Name))
	case apierrors.IsNotFound(err):
		// The broker's own namespace is missing: an operator problem.
		return problem.Wrap(problem.KindInternal, "", fmt.Errorf("record used join token in namespace %q: %w", b.cfg.Namespace, err))
	}
	return problem.Classify(err, "record used join token", "namespace not found")
}

// sign issues the certificate for identity with the peer's lifetime,
// shortened (and logged) when the CA expires sooner: near the end of a CA's
// life clusters get shorter certificates rather than none.
func (b *Broker) sign(csr *x509.CertificateRequest, identity string, log *zap.Logger) (*apiv1.CertificateResponse, error) {
	ttl := b.cfg.CertificateTTL
	if p := b.cfg.Policy.Load(); p != nil {
		ttl = p.CertificateTTL(identity, ttl)
	}
	if left := b.cfg.CA.Certificate().NotAfter.Sub(b.cfg.Clock.Now()) - caExpirySlack; ttl > left && left >= policy.MinCertificateTTL {
		log.Warn("certificate lifetime shortened: the signing CA expires sooner; rotate the CA",
			zap.Duration("ttl", ttl), zap.Duration("granted", left.Truncate(time.Second)),
			zap.Time("ca_not_after", b.cfg.CA.Certificate().NotAfter))
		ttl = left.Truncate(time.Second)
	}
	t0 := b.cfg.Clock.Now()
	kp, err := b.cfg.CA.SignClient(csr, identity, ttl)
	b.cfg.Metrics.ObserveAPI("sign_client_certificate", b.cfg.Clock.Since(t0))
	if err != nil {
		if errors.Is(err, pki.ErrInvalidCSR) {
			return nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid",
				Fields: []apiv1.FieldError{{Field: "csr", Detail: csrProblem(err)}}, Err: err}
		}
		return nil, fmt.Errorf("sign client certificate for %s: %w", identity, err)
	}
	resp := &apiv1.CertificateResponse{
		Identity:     identity,
		Certificate:  string(kp.CertPEM),
		SerialNumber: kp.Cert.SerialNumber.Text(16),
		NotBefore:    kp.Cert.NotBefore.UTC(),
		NotAfter:     kp.Cert.NotAfter.UTC(),
	}
	if b.cfg.Trust != nil {
		resp.CABundle = string(b.cfg.Trust.PEM())
	}
	return resp, nil
}

// csrDenial is the denial reason code of a refused CSR.
func csrDenial(err error) string {
	if problem.KindOf(err) == problem.KindForbidden {
		return denyIdentityMismatch
	}
	return denyInvalid
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

func outcomeOfCert(err error) string { return labelOf(err, certOutcomes, certError) }
