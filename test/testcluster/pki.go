package testcluster

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// File names inside Cluster.Dir. Keys are written 0600 and never logged.
const (
	caCertFile       = "ca.crt"
	caKeyFile        = "ca.key"
	servingCertFile  = "apiserver.crt"
	servingKeyFile   = "apiserver.key"
	saPublicKeyFile  = "sa.pub"
	saPrivateKeyFile = "sa.key"
	adminCertFile    = "admin.crt"
	adminKeyFile     = "admin.key"
	kubeconfigFile   = "admin.kubeconfig"
)

// certValidity is long enough for a `make dev` session left running for
// days; these certificates never leave the machine.
const certValidity = 30 * 24 * time.Hour

// pkiMaterial is the PEM of what the cluster's clients need in memory. Every
// key, including these, is also on disk in Cluster.Dir for the child
// processes.
type pkiMaterial struct {
	ca        *keyPair
	caCert    []byte
	adminCert []byte
	adminKey  []byte
}

// keyPair is a certificate and its key.
type keyPair struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// writePKI creates the cluster CA, the API server's serving certificate, the
// service-account signing key pair and the admin client certificate in dir.
func writePKI(dir string) (*pkiMaterial, error) {
	now := time.Now()
	ca, err := newCA(now)
	if err != nil {
		return nil, err
	}
	caPEM := encodeCert(ca.cert)
	if err := writeCertAndKey(dir, caCertFile, caKeyFile, caPEM, ca.key); err != nil {
		return nil, err
	}

	serving, err := issue(ca, now, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames: []string{
			"localhost", "kubernetes", "kubernetes.default",
			"kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
		},
		// 10.0.0.1 is the "kubernetes" Service's ClusterIP in serviceCIDR.
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 0, 0, 1)},
	})
	if err != nil {
		return nil, err
	}
	if err := writeCertAndKey(dir, servingCertFile, servingKeyFile, encodeCert(serving.cert), serving.key); err != nil {
		return nil, err
	}

	admin, err := issue(ca, now, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "tokenbroker-test-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return nil, err
	}
	adminCertPEM := encodeCert(admin.cert)
	if err := writeCertAndKey(dir, adminCertFile, adminKeyFile, adminCertPEM, admin.key); err != nil {
		return nil, err
	}
	adminKeyPEM, err := encodeKey(admin.key)
	if err != nil {
		return nil, err
	}

	if err := writeServiceAccountKeys(dir); err != nil {
		return nil, err
	}
	return &pkiMaterial{ca: ca, caCert: caPEM, adminCert: adminCertPEM, adminKey: adminKeyPEM}, nil
}

func newCA(now time.Time) (*keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "tokenbroker-test-cluster-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	return &keyPair{cert: cert, key: key}, nil
}

// issue signs a leaf certificate from tmpl (subject, SANs, extended key
// usage) with a fresh P-256 key.
func issue(ca *keyPair, now time.Time, tmpl *x509.Certificate) (*keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key for %q: %w", tmpl.Subject.CommonName, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = now.Add(-time.Hour)
	tmpl.NotAfter = now.Add(certValidity)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, fmt.Errorf("create certificate %q: %w", tmpl.Subject.CommonName, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse certificate %q: %w", tmpl.Subject.CommonName, err)
	}
	return &keyPair{cert: cert, key: key}, nil
}

// writeServiceAccountKeys writes the key pair the API server signs (and
// verifies) service account tokens with. ES256 is accepted for both.
func writeServiceAccountKeys(dir string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate service account key: %w", err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return fmt.Errorf("marshal service account public key: %w", err)
	}
	pubPEM := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
	if err := writeFile(filepath.Join(dir, saPrivateKeyFile), keyPEM, 0o600); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, saPublicKeyFile), pubPEM, 0o644)
}

func writeCertAndKey(dir, certName, keyName string, certPEM []byte, key crypto.Signer) error {
	keyPEM, err := encodeKey(key)
	if err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dir, certName), certPEM, 0o644); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, keyName), keyPEM, 0o600)
}

func encodeCert(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

func encodeKey(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// randomSerial returns a random 128-bit serial number.
func randomSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("generate serial number: %w", err)
	}
	return serial, nil
}

func writeFile(path string, data []byte, perm os.FileMode) error {
	if err := os.WriteFile(path, data, perm); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return nil
}
