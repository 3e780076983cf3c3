// Package clientcert issues Kubernetes client certificates through the
// CertificateSigningRequest API (signer kubernetes.io/kube-apiserver-client)
// for a per-lease user, and makes them revocable: the user's only
// permission is a RoleBinding owned by the lease object, so deleting the
// lease (or the binding) takes everything away from a certificate that
// Kubernetes itself cannot revoke.
//
// The broker's ServiceAccount needs, for this issuer: create, get, watch and
// delete on certificatesigningrequests; update on
// certificatesigningrequests/approval; approve on signers named
// kubernetes.io/kube-apiserver-client; create and delete on rolebindings in
// the granted namespaces; and bind on exactly the granted roles. The
// approve permission lets its holder mint a client certificate for almost
// any user: docs/security.md says how to contain it.
package clientcert

import (
	"bytes"
	"context"
	"crypto"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	authnv1 "k8s.io/api/authentication/v1"
	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	watchtools "k8s.io/client-go/tools/watch"

	"github.com/tokenbroker/tokenbroker/issuers"
)

// Signer is the signer the certificates are requested from.
const Signer = certv1.KubeAPIServerClientSignerName

// MinTTL is the shortest lifetime the CSR API accepts (expirationSeconds
// ≥ 600).
const MinTTL = 10 * time.Minute

// ClampedByMinimum reports a TTL raised to MinTTL.
const ClampedByMinimum = "csr.minimum"

// DefaultTimeout is how long Issue waits for the signer by default.
const DefaultTimeout = 10 * time.Second

// ErrNotSigned is wrapped when the signer did not issue the certificate in
// time: a cluster without a signer for kubernetes.io/kube-apiserver-client
// (kube-controller-manager without --cluster-signing-cert-file, EKS), or
// one that is overloaded. Retryable.
var ErrNotSigned = errors.New("the certificate signing request was not signed in time")

// ErrRefused is wrapped when the cluster denied or failed the request (an
// admission policy, a signer that refuses): not retryable as is.
var ErrRefused = errors.New("the cluster refused the certificate signing request")

// Labels on the objects the issuer makes, so that an operator can find them
// (kubectl get csr,rolebindings -l tokenbroker.io/lease-id=...).
const (
	labelManagedBy = "app.kubernetes.io/managed-by"
	labelLeaseID   = "tokenbroker.io/lease-id"
	labelKind      = "tokenbroker.io/kind"
	// KindBinding marks the RoleBinding of a certificate lease.
	KindBinding = "lease-binding"
)

// Issuer mints client certificates for per-lease users.
type Issuer struct {
	client  kubernetes.Interface
	timeout time.Duration
	log     *zap.Logger

	selfMu sync.Mutex
	self   string // the broker's own user name, once known
}

// New returns an Issuer that waits at most timeout for the signer (zero:
// DefaultTimeout) and logs the clean-ups that fail to log (nil: none).
func New(client kubernetes.Interface, timeout time.Duration, log *zap.Logger) *Issuer {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	if log == nil {
		log = zap.NewNop()
	}
	return &Issuer{client: client, timeout: timeout, log: log}
}

// Kind is issuers.KindClientCertificate.
func (*Issuer) Kind() string { return issuers.KindClientCertificate }

// Limits: at least ten minutes (the signer may cap the lifetime at its
// CA's expiry, which the broker reads from the certificate), revoked by
// deleting the lease, which owns the only RoleBinding of the user.
func (*Issuer) Limits() issuers.Limits {
	return issuers.Limits{MinTTL: MinTTL, MinClampedBy: ClampedByMinimum, Revocation: issuers.RevokedByRoleBinding}
}

// Issue binds req.Role to req.User in req.Namespace with a RoleBinding
// owned by req.Lease, creates a CSR for req.CSR, approves it after checking
// that it is the one it created, waits at most the issuer's timeout for
// the certificate and returns it (without a key: the caller holds it). On
// any failure it deletes what it created. The CSR object is deleted once
// the certificate is read; the lease and the audit log record it.
func (i *Issuer) Issue(ctx context.Context, req issuers.Request) (issuers.Credential, error) {
	if req.Lease.Name == "" || req.Lease.UID == "" {
		return issuers.Credential{}, errors.New("clientcert: a lease object to own the RoleBinding is required")
	}
	if req.User == "" || req.Role.Name == "" || (req.Role.Kind != "Role" && req.Role.Kind != "ClusterRole") {
		return issuers.Credential{}, errors.New("clientcert: a user and a Role or ClusterRole are required")
	}
	// The broker parsed and checked the CSR (pki.ParseUserCSRPEM); the
	// issuer checks that it asks for the user it binds, so that nothing
	// else is ever approved.
	csr := req.CSR
	if csr == nil {
		return issuers.Credential{}, errors.New("clientcert: a CSR is required")
	}
	if cn := csr.Subject.CommonName; cn != req.User {
		return issuers.Credential{}, fmt.Errorf("clientcert: the CSR asks for user %q, not %q", cn, req.User)
	}
	self, err := i.selfUser(ctx)
	if err != nil {
		return issuers.Credential{}, err
	}

	rb, err := i.client.RbacV1().RoleBindings(req.Namespace).Create(ctx, binding(req), metav1.CreateOptions{})
	if err != nil {
		return issuers.Credential{}, fmt.Errorf("create RoleBinding: %w", err)
	}
	cred, err := i.sign(ctx, req, csr, self)
	if err != nil {
		// The binding would go with the lease too; deleting it now leaves
		// nothing behind even before the broker deletes the lease.
		i.cleanUp("RoleBinding "+req.Namespace+"/"+rb.Name, func(ctx context.Context) error {
			return i.client.RbacV1().RoleBindings(req.Namespace).Delete(ctx, rb.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &rb.UID}})
		})
		return issuers.Credential{}, err
	}
	return cred, nil
}

// binding is the RoleBinding of the per-lease user, owned by the lease.
func binding(req issuers.Request) *rbacv1.RoleBinding {
	return &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{
			Name:      req.Lease.Name,
			Namespace: req.Namespace,
			Labels:    labels(req, KindBinding),
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "v1",
				Kind:       req.Lease.Kind,
				Name:       req.Lease.Name,
				UID:        req.Lease.UID,
			}},
		},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: req.Role.Kind, Name: req.Role.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: req.User}},
	}
}

func labels(req issuers.Request, kind string) map[string]string {
	l := map[string]string{labelManagedBy: "tokenbroker", labelKind: kind}
	if id, ok := strings.CutPrefix(req.Lease.Name, "tokenbroker-lease-"); ok {
		l[labelLeaseID] = id
	}
	return l
}

// sign creates, approves and waits for the CSR, and deletes it whatever
// happens.
func (i *Issuer) sign(ctx context.Context, req issuers.Request, parsed *x509.CertificateRequest, self string) (issuers.Credential, error) {
	seconds := int32(req.TTL / time.Second)
	usages := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageClientAuth}
	if _, ok := parsed.PublicKey.(*rsa.PublicKey); ok {
		usages = append(usages, certv1.UsageKeyEncipherment)
	}
	request := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: parsed.Raw})
	csrs := i.client.CertificatesV1().CertificateSigningRequests()
	created, err := csrs.Create(ctx, &certv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: req.Lease.Name, Labels: labels(req, "lease-csr")},
		Spec: certv1.CertificateSigningRequestSpec{
			Request:           request,
			SignerName:        Signer,
			ExpirationSeconds: &seconds,
			Usages:            usages,
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return issuers.Credential{}, fmt.Errorf("create CertificateSigningRequest: %w", err)
	}
	defer i.cleanUp("CertificateSigningRequest "+created.Name, func(ctx context.Context) error {
		return csrs.Delete(ctx, created.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &created.UID}})
	})

	// Approve only what this broker created, for the user it chose: the
	// API server sets spec.username to the creator, and the request must
	// be byte for byte the one checked above.
	if created.Spec.Username != self {
		return issuers.Credential{}, fmt.Errorf("clientcert: CSR %s was created by %q, not by this broker (%q); not approving it", created.Name, created.Spec.Username, self)
	}
	if !bytes.Equal(created.Spec.Request, request) || created.Spec.SignerName != Signer {
		return issuers.Credential{}, fmt.Errorf("clientcert: CSR %s is not the request this broker made; not approving it", created.Name)
	}
	created.Status.Conditions = append(created.Status.Conditions, certv1.CertificateSigningRequestCondition{
		Type:    certv1.CertificateApproved,
		Status:  corev1.ConditionTrue,
		Reason:  "TokenbrokerLease",
		Message: "approved by tokenbroker for lease " + req.Lease.Name + " in " + req.Namespace,
	})
	approved, err := csrs.UpdateApproval(ctx, created.Name, created, metav1.UpdateOptions{})
	if err != nil {
		return issuers.Credential{}, fmt.Errorf("approve CertificateSigningRequest: %w", err)
	}

	certPEM, err := i.waitSigned(ctx, approved)
	if err != nil {
		return issuers.Credential{}, err
	}
	cert, err := issuedCertificate(certPEM, parsed.PublicKey, req.User)
	if err != nil {
		return issuers.Credential{}, err
	}
	return issuers.Credential{CertificatePEM: certPEM, Leaf: cert, NotBefore: cert.NotBefore, ExpiresAt: cert.NotAfter}, nil
}

// waitSigned watches the CSR until the signer has issued the certificate,
// the CSR is denied or failed, or the issuer's timeout passes.
func (i *Issuer) waitSigned(ctx context.Context, csr *certv1.CertificateSigningRequest) ([]byte, error) {
	if len(csr.Status.Certificate) > 0 {
		return csr.Status.Certificate, nil
	}
	ctx, cancel := context.WithTimeout(ctx, i.timeout)
	defer cancel()
	csrs := i.client.CertificatesV1().CertificateSigningRequests()
	var certPEM []byte
	done := func(ev watch.Event) (bool, error) {
		switch ev.Type {
		case watch.Deleted:
			return false, fmt.Errorf("%w: CSR %s was deleted", ErrRefused, csr.Name)
		case watch.Error:
			return false, apierrors.FromObject(ev.Object)
		}
		c, ok := ev.Object.(*certv1.CertificateSigningRequest)
		if !ok {
			return false, nil
		}
		for _, cond := range c.Status.Conditions {
			if (cond.Type == certv1.CertificateDenied || cond.Type == certv1.CertificateFailed) && cond.Status == corev1.ConditionTrue {
				return false, fmt.Errorf("%w: %s: %s", ErrRefused, cond.Reason, cond.Message)
			}
		}
		certPEM = c.Status.Certificate
		return len(certPEM) > 0, nil
	}
	for {
		w, err := csrs.Watch(ctx, metav1.ListOptions{
			FieldSelector:   fields.OneTermEqualSelector("metadata.name", csr.Name).String(),
			ResourceVersion: csr.ResourceVersion,
		})
		if err == nil {
			_, err = watchtools.UntilWithoutRetry(ctx, w, done)
			if err == nil {
				return certPEM, nil
			}
		}
		switch {
		case ctx.Err() != nil:
			return nil, fmt.Errorf("%w: no certificate for CSR %s after %s (does this cluster sign for %s?)", ErrNotSigned, csr.Name, i.timeout, Signer)
		case errors.Is(err, watchtools.ErrWatchClosed):
			// The API server ended the watch early: read the CSR again and
			// watch on from there.
			c, err := csrs.Get(ctx, csr.Name, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("get CertificateSigningRequest: %w", err)
			}
			if ok, err := done(watch.Event{Type: watch.Modified, Object: c}); ok || err != nil {
				return certPEM, err
			}
			csr = c
		default:
			return nil, fmt.Errorf("watch CertificateSigningRequest: %w", err)
		}
	}
}

// issuedCertificate parses what the signer issued and checks that it is
// for the key and user asked for.
func issuedCertificate(certPEM []byte, pub crypto.PublicKey, user string) (*x509.Certificate, error) {
	block, _ := pem.Decode(certPEM)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, errors.New("clientcert: the signer returned no PEM certificate")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("clientcert: the signer returned a certificate that does not parse: %w", err)
	}
	k, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !k.Equal(pub) {
		return nil, errors.New("clientcert: the signed certificate is not for the requested key")
	}
	if cert.Subject.CommonName != user || len(cert.Subject.Organization) != 0 {
		return nil, fmt.Errorf("clientcert: the signed certificate is for %q, not %q", cert.Subject, user)
	}
	return cert, nil
}

// selfUser is the broker's own user name, as the API server sees it
// (SelfSubjectReview), asked once.
func (i *Issuer) selfUser(ctx context.Context) (string, error) {
	i.selfMu.Lock()
	defer i.selfMu.Unlock()
	if i.self != "" {
		return i.self, nil
	}
	r, err := i.client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("who am I (SelfSubjectReview): %w", err)
	}
	if r.Status.UserInfo.Username == "" {
		return "", errors.New("who am I (SelfSubjectReview): no user name")
	}
	i.self = r.Status.UserInfo.Username
	return i.self, nil
}

// cleanUp runs a best-effort delete with its own short deadline, so that a
// cancelled request still cleans up; NotFound is success.
func (i *Issuer) cleanUp(what string, del func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := del(ctx); err != nil && !apierrors.IsNotFound(err) {
		// Nothing to return it to. A RoleBinding left behind goes with its
		// lease, which the broker deletes; a CSR left behind is removed by
		// kube-controller-manager's csrcleaner (within an hour once issued
		// or denied, a day if pending) and holds no secret.
		i.log.Warn("clean-up failed", zap.String("object", what), zap.Error(err))
	}
}
