package broker

import (
	"context"
	"crypto/x509"

	corev1 "k8s.io/api/core/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/issuers/clientcert"
	"github.com/tokenbroker/tokenbroker/pki"
)

// kind is one credential kind's part of an issuance: a token, a client
// certificate or a gateway lease. Broker.issue decides, admits, makes the
// lease, audits and answers, the same for every kind; a kind checks what
// only it knows before any object exists (its CSR, parsed once here and
// handed to the issuer parsed), shapes the lease Secret and the issuer's
// request, and says how it is issued on a pooled Secret.
type kind interface {
	// prepare checks req for the kind before any object is made, with
	// the decision d; an error is the request's outcome.
	prepare(ctx context.Context, b *Broker, p *policy.Policy, d policy.Decision, req apiv1.KubeconfigRequest, a *audit.Pending) (outcome string, err error)
	// cluster is the cluster the kubeconfig names.
	cluster(b *Broker, p *policy.Policy) (policy.ClusterSpec, error)
	// shape writes the kind's part of the lease Secret and the issuer's
	// request.
	shape(ls *corev1.Secret, ireq *issuers.Request)
	// pool is how a pooled Secret serves the kind.
	pool() poolUse
	// subject is the kubeconfig's user: the ServiceAccount, or the
	// certificate's user.
	subject(req apiv1.KubeconfigRequest) string
	// finish completes the issued credential: a key the broker made.
	finish(cred *issuers.Credential)
	// signed says whether the cluster's signer issues the credential
	// (policy.Granted: a shortened one is ClampedBySigner).
	signed() bool
	// apiID is the id the API server logs for every request made with
	// the credential, "" when it never reaches the API server.
	apiID(ref issuers.Ref) string
}

// poolUse is how a pooled Secret serves a kind (pool.go).
type poolUse int

const (
	// poolNone: always the sequential path (a client certificate: the
	// signer's wait dwarfs the create).
	poolNone poolUse = iota
	// poolAlongside: the credential is issued and the Secret claimed at
	// once, answered once both are done (a token, valid at the API server
	// as soon as it exists).
	poolAlongside
	// poolAfterAnswer: the credential is signed for the Secret, answered,
	// and the Secret claimed after the answer (a gateway lease, good at no
	// gateway until the claim lands).
	poolAfterAnswer
)

// kindOf is the kind of decision d.
func kindOf(d policy.Decision) kind {
	switch {
	case d.Access == apiv1.AccessGateway:
		return &gatewayKind{}
	case d.Credential == apiv1.CredentialClientCertificate:
		return &certificateKind{role: d.Role}
	}
	return tokenKind{}
}

// tokenKind is a bound ServiceAccount token.
type tokenKind struct{}

func (tokenKind) prepare(_ context.Context, _ *Broker, _ *policy.Policy, _ policy.Decision, req apiv1.KubeconfigRequest, a *audit.Pending) (string, error) {
	if req.CSR != "" {
		a.Denial = audit.DenyInvalid
		return outcomeInvalid, problem.Errorf(problem.KindInvalid, "csr is only for credential clientCertificate or a gateway lease, and the grant of this request is neither")
	}
	return "", nil
}

func (tokenKind) cluster(_ *Broker, p *policy.Policy) (policy.ClusterSpec, error) {
	return p.Cluster, nil
}
func (tokenKind) shape(*corev1.Secret, *issuers.Request)     {}
func (tokenKind) pool() poolUse                              { return poolAlongside }
func (tokenKind) subject(req apiv1.KubeconfigRequest) string { return req.ServiceAccount }
func (tokenKind) finish(*issuers.Credential)                 {}
func (tokenKind) signed() bool                               { return false }
func (tokenKind) apiID(ref issuers.Ref) string               { return ref.APIID }

// certificateKind is a client certificate through the CSR API, for a
// per-lease user bound to role.
type certificateKind struct {
	role issuers.RoleRef
	csr  *clientcert.CSR
}

func (k *certificateKind) prepare(ctx context.Context, b *Broker, p *policy.Policy, d policy.Decision, req apiv1.KubeconfigRequest, a *audit.Pending) (string, error) {
	csr, err := b.certificateRequest(ctx, p, d, req)
	if err != nil {
		if problem.KindOf(err) == problem.KindInvalid {
			return outcomeInvalid, err
		}
		return outcomeFor(err), err
	}
	k.csr, a.Event.User = csr, csr.User
	return "", nil
}

func (*certificateKind) cluster(_ *Broker, p *policy.Policy) (policy.ClusterSpec, error) {
	return p.Cluster, nil
}

func (k *certificateKind) shape(ls *corev1.Secret, ireq *issuers.Request) {
	ls.Annotations[objects.AnnotationUser] = k.csr.User
	ls.Labels[objects.LabelKeyFingerprint] = k.csr.Fingerprint
	ireq.CSR, ireq.User, ireq.Role = k.csr.Parsed, k.csr.User, k.role
}

func (*certificateKind) pool() poolUse                            { return poolNone }
func (k *certificateKind) subject(apiv1.KubeconfigRequest) string { return k.csr.User }

// finish hands over the key the broker made (nil when the caller holds
// it).
func (k *certificateKind) finish(cred *issuers.Credential) { cred.KeyPEM = k.csr.KeyPEM }
func (*certificateKind) signed() bool                      { return true }
func (*certificateKind) apiID(ref issuers.Ref) string      { return ref.APIID }

// gatewayKind is a gateway lease: a lease certificate good at the
// broker's lease gateway only.
type gatewayKind struct {
	csr *x509.CertificateRequest // nil: the issuer makes the key
}

// prepare parses the caller's CSR, if any: the issuer signs for its key.
func (k *gatewayKind) prepare(_ context.Context, _ *Broker, _ *policy.Policy, _ policy.Decision, req apiv1.KubeconfigRequest, _ *audit.Pending) (string, error) {
	if req.CSR == "" {
		return "", nil
	}
	csr, err := pki.ParseLeaseCSRPEM([]byte(req.CSR))
	if err != nil {
		return outcomeInvalid, problem.Wrap(problem.KindInvalid, "csr: "+err.Error(), err)
	}
	k.csr = csr
	return "", nil
}

// cluster is the gateway's: its URL and the CAs of its serving
// certificate, checked before any object is made.
func (*gatewayKind) cluster(b *Broker, p *policy.Policy) (policy.ClusterSpec, error) {
	return b.cfg.Gateway.cluster(p.Cluster)
}

func (k *gatewayKind) shape(ls *corev1.Secret, ireq *issuers.Request) {
	ls.Annotations[objects.AnnotationAccess] = apiv1.AccessGateway
	ireq.CSR = k.csr
}

func (*gatewayKind) pool() poolUse                              { return poolAfterAnswer }
func (*gatewayKind) subject(req apiv1.KubeconfigRequest) string { return req.ServiceAccount }

func (*gatewayKind) finish(*issuers.Credential) {}
func (*gatewayKind) signed() bool               { return false }

// apiID: a lease certificate never reaches the API server, so it has no
// id there (the gateway's requests are joined by their audit ids), and
// none is written after the answer.
func (*gatewayKind) apiID(issuers.Ref) string { return "" }
