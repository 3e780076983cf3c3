package pki

import (
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// A pod certificate (Kubernetes' PodCertificateRequest, KEP-4317) names
// one workload of one cluster: its ServiceAccount, as the SPIFFE ID
//
//	spiffe://<trust domain>/cluster/<cluster>/ns/<namespace>/sa/<serviceAccount>
//
// under the cluster's own identity. It is signed by the cluster's CA (an
// intermediate of the fleet's), so that whoever verifies one knows which
// cluster vouched for the workload; X.509 name constraints cannot bound a
// URI's path, so a relying party must check that the identity is under
// the cluster of the CA that signed it (WorkloadFromChain).

const (
	nsPath = "ns"
	saPath = "sa"
)

// ErrInvalidWorkloadIdentity is wrapped by every workload identity
// validation error.
var ErrInvalidWorkloadIdentity = errors.New("invalid workload identity")

// WorkloadIdentity is the SPIFFE ID of the ServiceAccount namespace/name in
// the cluster of clusterIdentity (a ClusterIdentity). namespace and name
// are DNS-1123 labels and subdomains as Kubernetes names them; nothing is
// normalised.
func WorkloadIdentity(clusterIdentity, namespace, serviceAccount string) (string, error) {
	if _, _, err := ParseIdentity(clusterIdentity); err != nil {
		return "", err
	}
	if !isLabel(namespace) {
		return "", fmt.Errorf("%w: namespace %q is not a DNS-1123 label", ErrInvalidWorkloadIdentity, namespace)
	}
	if strings.HasPrefix(serviceAccount, "*") || validateDNSName(serviceAccount) != nil {
		return "", fmt.Errorf("%w: ServiceAccount %q is not a DNS-1123 subdomain", ErrInvalidWorkloadIdentity, serviceAccount)
	}
	return clusterIdentity + "/" + nsPath + "/" + namespace + "/" + saPath + "/" + serviceAccount, nil
}

// ParseWorkloadIdentity splits a WorkloadIdentity into the identity of
// its cluster, its namespace and its ServiceAccount, or fails with
// ErrInvalidWorkloadIdentity.
func ParseWorkloadIdentity(id string) (clusterIdentity, namespace, serviceAccount string, err error) {
	bad := func(why string) (string, string, string, error) {
		return "", "", "", fmt.Errorf("%w: %q: %s", ErrInvalidWorkloadIdentity, id, why)
	}
	if len(id) > maxIdentityLen {
		return "", "", "", fmt.Errorf("%w: longer than %d bytes", ErrInvalidWorkloadIdentity, maxIdentityLen)
	}
	if !strings.HasPrefix(id, spiffeScheme) {
		return bad("not a spiffe:// ID")
	}
	parts := strings.Split(strings.TrimPrefix(id, spiffeScheme), "/")
	// trust domain, "cluster", cluster, "ns", namespace, "sa", name
	if len(parts) != 7 || parts[3] != nsPath || parts[5] != saPath {
		return bad("want spiffe://<trust domain>/cluster/<cluster>/ns/<namespace>/sa/<serviceAccount>")
	}
	clusterIdentity = spiffeScheme + strings.Join(parts[:3], "/")
	if _, _, err := ParseIdentity(clusterIdentity); err != nil {
		return bad(err.Error())
	}
	want, err := WorkloadIdentity(clusterIdentity, parts[4], parts[6])
	if err != nil || want != id {
		return bad("its namespace or ServiceAccount is not a Kubernetes name")
	}
	return clusterIdentity, parts[4], parts[6], nil
}

// PodCertificate is what SignPodCertificate asks for: the workload's
// identity (WorkloadIdentity, under the CA's cluster) and public key, and
// the certificate's validity, in whole seconds (a PodCertificateRequest's
// status records them at that precision and must equal the
// certificate's).
type PodCertificate struct {
	Identity  string
	PublicKey crypto.PublicKey
	NotBefore time.Time
	NotAfter  time.Time
	// PodName and PodUID name the Pod in the certificate's subject
	// (WorkloadFromChain reads them); both or neither.
	PodName string
	PodUID  string
}

// SignPodCertificate signs a pod certificate: a client certificate for
// p.PublicKey whose only name is the URI p.Identity, valid from
// p.NotBefore to p.NotAfter, which must lie within the CA's own validity.
// clusterIdentity is the cluster the CA signs for; an identity under any
// other cluster is refused, so that a cluster's CA never vouches for
// another's workloads; a cluster CA (SignClusterCA) signs for the
// cluster it names only, whatever clusterIdentity says. It returns the
// certificate and the chain to publish: the leaf, then the CA's chain
// (the root left out).
func (ca *CA) SignPodCertificate(clusterIdentity string, p PodCertificate) (*x509.Certificate, []byte, error) {
	cluster, _, _, err := ParseWorkloadIdentity(p.Identity)
	if err != nil {
		return nil, nil, err
	}
	if cluster != clusterIdentity {
		return nil, nil, fmt.Errorf("%w: %s is not under %s, the cluster this CA signs for", ErrInvalidWorkloadIdentity, p.Identity, clusterIdentity)
	}
	// A cluster CA (SignClusterCA) names its cluster: it signs for that
	// one whatever its caller says.
	if own, err := ClusterCAIdentity(ca.cert); err == nil && own != clusterIdentity {
		return nil, nil, fmt.Errorf("%w: this CA is the cluster CA of %s, not of %s", ErrInvalidWorkloadIdentity, own, clusterIdentity)
	}
	if !p.NotBefore.Equal(p.NotBefore.Truncate(time.Second)) || !p.NotAfter.Equal(p.NotAfter.Truncate(time.Second)) {
		return nil, nil, errors.New("sign pod certificate: validity must be in whole seconds")
	}
	if !p.NotAfter.After(p.NotBefore) {
		return nil, nil, errors.New("sign pod certificate: NotAfter must follow NotBefore")
	}
	if p.NotBefore.Before(ca.cert.NotBefore) {
		return nil, nil, fmt.Errorf("sign pod certificate: NotBefore %s precedes the CA's %s", p.NotBefore.UTC().Format(time.RFC3339), ca.cert.NotBefore.UTC().Format(time.RFC3339))
	}
	if err := ca.checkValidity(p.NotBefore, p.NotAfter); err != nil {
		return nil, nil, fmt.Errorf("sign pod certificate: %w", err)
	}
	u, err := url.Parse(p.Identity)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrInvalidWorkloadIdentity, err)
	}
	subject, err := podSubject(p.PodName, p.PodUID)
	if err != nil {
		return nil, nil, fmt.Errorf("sign pod certificate: %w", err)
	}
	tmpl := &x509.Certificate{
		Subject:               subject,
		URIs:                  []*url.URL{u},
		NotBefore:             p.NotBefore,
		NotAfter:              p.NotAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	cert, err := createCert(ca.rand, tmpl, ca.cert, p.PublicKey, ca.signer)
	if err != nil {
		return nil, nil, fmt.Errorf("sign pod certificate: %w", err)
	}
	return cert, ca.chainPEM(cert), nil
}
